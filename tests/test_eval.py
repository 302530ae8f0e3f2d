"""`ftctl eval`: strict scoring, prompt/reference splitting, batched greedy generation, eval.json end to end."""

from __future__ import annotations

import json

import pytest

from ftctl.errors import ConfigError, FtctlError
from ftctl.evaluation.scoring import choose_metric, exact_match, json_match, score


def test_exact_match_trims_whitespace_only():
    assert exact_match("  Paris\n", "Paris")
    assert not exact_match("paris", "Paris")
    assert not exact_match("Paris.", "Paris")


@pytest.mark.parametrize(
    "prediction, expected",
    [
        ('{"city": "Oslo", "quantity": 3}', True),
        ('{\n  "quantity": 3,\n  "city": "Oslo"\n}', True),  # layout and key order do not matter
        ('```json\n{"city": "Oslo", "quantity": 3}\n```', False),  # a code fence is not JSON
        ('{"city": "Oslo", "quantity": 3} Hope this helps!', False),
        ('{"city": "Oslo", "quantity": "3"}', False),
        ('{"city": "Oslo", "quantity": 3.0}', False),
        ('{"city": "oslo", "quantity": 3}', False),
        ('{"city": "Oslo"}', False),
        ("", False),
    ],
)
def test_json_match_is_strict(prediction, expected):
    assert json_match(prediction, '{"city": "Oslo", "quantity": 3}') is expected


def test_json_match_keeps_booleans_apart_from_numbers():
    assert not json_match("[1]", "[true]")


def test_choose_metric_and_score():
    assert choose_metric("auto", ['{"a": 1}', "[2]"]) == "json_match"
    assert choose_metric("auto", ['{"a": 1}', "Paris"]) == "exact_match"
    assert choose_metric("exact_match", ['{"a": 1}']) == "exact_match"
    with pytest.raises(ConfigError, match="json_match"):
        choose_metric("json_matc", ["x"])
    assert score("exact_match", ["a", "b ", "c"], ["a", "b", "x"]) == [True, True, False]


def test_held_out_examples_split_at_the_last_assistant_turn(tmp_path):
    from ftctl.evaluation.evaluate import held_out_examples
    from ftctl.paths import samples_dir

    fmt, examples = held_out_examples(samples_dir() / "sharegpt_sample.jsonl", None, n=2)
    assert fmt == "sharegpt" and len(examples) == 2
    first = json.loads((samples_dir() / "sharegpt_sample.jsonl").read_text().splitlines()[0])["conversations"]
    assert examples[0].reference == first[-1]["value"]
    assert [m["content"] for m in examples[0].prompt] == [t["value"] for t in first[:-1]]
    assert examples[0].prompt[-1]["role"] == "user"

    path = tmp_path / "a.jsonl"
    path.write_text(json.dumps({"instruction": "Add.", "input": "1 + 2", "output": "3"}) + "\n")
    fmt, (example,) = held_out_examples(path, "alpaca", system_prompt="Be terse.")
    assert example.prompt == [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Add.\n\n1 + 2"}]
    assert example.reference == "3"
    with pytest.raises(FtctlError, match=r"a\.jsonl:1: not a valid 'sharegpt' record.*data.format=alpaca"):
        held_out_examples(path, "sharegpt")


@pytest.fixture(scope="module")
def tiny_lm(tiny_model_dir):
    from ftctl.evaluation.evaluate import load_for_generation

    return load_for_generation(str(tiny_model_dir), None)


PROMPTS = [
    [{"role": "user", "content": "Reverse the word."}],
    [{"role": "system", "content": "Answer with a JSON object."}, {"role": "user", "content": "Extract the colour and the animal. I saw a green cat today."}],
    [{"role": "user", "content": "Add 2 and 3"}],
]


def test_generate_batched_with_left_padding_equals_one_by_one_greedy(tiny_lm):
    import torch

    from ftctl.evaluation.generation import generate, prompt_ids

    model, tokenizer = tiny_lm
    batched = generate(model, tokenizer, PROMPTS, max_new_tokens=6, batch_size=3)
    single = [generate(model, tokenizer, [p], max_new_tokens=6)[0] for p in PROMPTS]
    assert batched == single
    # One prompt by hand: repeated argmax over the full sequence, no cache, no padding.
    ids = prompt_ids(tokenizer, PROMPTS[1])
    new = []
    with torch.no_grad():
        for _ in range(6):
            token = int(model(torch.tensor([ids + new])).logits[0, -1].argmax())
            if token == tokenizer.eos_token_id:
                break
            new.append(token)
    assert batched[1] == tokenizer.decode(new, skip_special_tokens=True)
    assert any(batched), "the tiny model should produce some text"


def _write_alpaca(path, rows):
    path.write_text("".join(json.dumps({"instruction": i, "output": o}) + "\n" for i, o in rows))


def test_eval_command_writes_eval_json_with_real_scores(tiny_lm, tiny_model_dir, tmp_path, capsys):
    from ftctl.cli import main
    from ftctl.evaluation.generation import generate

    model, tokenizer = tiny_lm
    instructions = ["Reverse the word.", "Add the two numbers.", "Give the plural of 'cat'."]
    answers = generate(model, tokenizer, [[{"role": "user", "content": i}] for i in instructions], max_new_tokens=5)
    # References: the model's own greedy answers for the first two, a wrong one for the third.
    data = tmp_path / "heldout.jsonl"
    _write_alpaca(data, list(zip(instructions, answers[:2] + [answers[2] + " WRONG"])))
    out = tmp_path / "eval"
    rc = main(["eval", f"model={tiny_model_dir}", f"data.path={data}", "data.format=alpaca",
               f"output={out}", "max_new_tokens=5", "metric=exact_match"])
    assert rc == 0
    summary = json.loads((out / "eval.json").read_text())
    assert summary["metric"] == "exact_match" and summary["n"] == 3
    assert summary["score"] == pytest.approx(2 / 3)
    rows = [json.loads(line) for line in (out / "predictions.jsonl").read_text().splitlines()]
    assert [r["correct"] for r in rows] == [True, True, False]
    assert "exact_match 0.667 (2/3)" in capsys.readouterr().out

    rc = main(["eval", f"model={tiny_model_dir}", f"data.path={data}", f"output={out}", "n=1", "max_new_tokens=5"])
    summary = json.loads((out / "eval.json").read_text())
    assert rc == 0 and summary["n"] == 1 and summary["data_format"] == "alpaca"


def test_eval_applies_an_adapter_and_finds_its_base(tiny_model_dir, tmp_path):
    """An adapter dir alone is enough: its base comes from adapter_config.json, and it changes the answers."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from ftctl.evaluation.evaluate import EvalRequest, load_for_generation, run_eval
    from ftctl.evaluation.generation import generate

    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    torch.manual_seed(0)
    peft_model = get_peft_model(base, LoraConfig(r=4, lora_alpha=64, target_modules="all-linear", init_lora_weights=False))
    adapter = tmp_path / "run" / "final"
    peft_model.save_pretrained(adapter)
    merged, tokenizer = load_for_generation(str(tiny_model_dir), adapter)
    plain, _ = load_for_generation(str(tiny_model_dir), None)
    prompts = [[{"role": "user", "content": f"Add {i} and {i + 1}"}] for i in range(4)]
    adapted_answers = generate(merged, tokenizer, prompts, max_new_tokens=6)
    assert adapted_answers != generate(plain, tokenizer, prompts, max_new_tokens=6)

    data = tmp_path / "heldout.jsonl"
    _write_alpaca(data, [(p[0]["content"], a) for p, a in zip(prompts, adapted_answers)])
    summary = run_eval(EvalRequest(data_path=str(data), output=str(tmp_path / "e"), adapter=str(tmp_path / "run"),
                                   max_new_tokens=6, metric="exact_match"))
    assert summary["score"] == 1.0 and summary["adapter"] == str(adapter)
    assert summary["model"] == str(tiny_model_dir)


def test_eval_option_errors(tmp_path, capsys):
    from ftctl.cli import main

    assert main(["eval", "modle=x", "data.path=y"]) == 2
    assert "unknown eval option 'modle'. Did you mean 'model'?" in capsys.readouterr().err
    assert main(["eval", "model=x"]) == 2
    assert "data.path=SOURCE" in capsys.readouterr().err
    assert main(["eval", "model=x", "data.path=y", "n=many"]) == 2
    assert "n=many: expected an integer" in capsys.readouterr().err
    data = tmp_path / "d.jsonl"
    _write_alpaca(data, [("q", "a")])
    assert main(["eval", f"adapter={tmp_path}", f"data.path={data}"]) == 1
    assert "no adapter_config.json" in capsys.readouterr().err


def test_eval_recipe_supplies_model_and_held_out_file():
    from ftctl.evaluation.evaluate import request_from_overrides

    req = request_from_overrides(["recipe=smollm2_demo", "n=5"])
    assert req.model == "smollm2-135m-instruct" and req.data_path.endswith("orders_heldout.alpaca.jsonl")
    assert req.data_format == "auto" and req.n == 5  # detected from the file
    req = request_from_overrides(["recipe=smollm2_demo", "adapter=runs/x"])
    assert req.model is None and req.adapter == "runs/x"


def test_eval_chat_and_generate_use_the_system_prompt_the_run_trained_with(make_cfg, run_training):
    from ftctl.chat import system_prompt
    from ftctl.evaluation.evaluate import request_from_overrides

    result, _ = run_training(make_cfg("train.max_steps=2", "train.save_every=1", "data.system_prompt=You are ShopBot."))
    checkpoint = result.run_dir / "checkpoints" / "step-1"
    for target in (result.run_dir, result.final_dir, checkpoint):
        assert request_from_overrides([f"adapter={target}", "data.path=x.jsonl"]).system_prompt == "You are ShopBot."
        assert system_prompt({"adapter": str(target)}) == "You are ShopBot."
    assert system_prompt({"model": str(result.run_dir)}) == "You are ShopBot."
    # Said otherwise, or about a model no ftctl run produced: the user's word, or none.
    assert system_prompt({"adapter": str(result.run_dir), "system": ""}) is None
    assert system_prompt({"adapter": str(result.run_dir), "system": "Be brief."}) == "Be brief."
    assert request_from_overrides([f"adapter={result.run_dir}", "data.path=x.jsonl", "data.system_prompt=Hi"]).system_prompt == "Hi"
    assert system_prompt({"model": str(result.run_dir.parent)}) is None


# --- metrics beyond exact match, named sets, perplexity, the lm-eval bridge ------------------------

def _lcs_f1(prediction: str, reference: str) -> float:
    """ROUGE-L F-measure written out: lowercased ASCII word tokens, longest common subsequence."""
    import re

    p, r = (re.findall(r"[a-z0-9]+", text.lower()) for text in (prediction, reference))
    table = [[0] * (len(r) + 1) for _ in range(len(p) + 1)]
    for i in range(len(p)):
        for j in range(len(r)):
            table[i + 1][j + 1] = table[i][j] + 1 if p[i] == r[j] else max(table[i][j + 1], table[i + 1][j])
    lcs = table[-1][-1]
    return 0.0 if not lcs else 2 * (lcs / len(p)) * (lcs / len(r)) / (lcs / len(p) + lcs / len(r))


@pytest.mark.parametrize("prediction, reference", [
    ("The cat sat on the mat.", "the cat lay on a mat"),
    ('{"city": "Oslo", "quantity": 3}', '{"quantity": 3, "city": "Oslo"}'),
    ("Paris", "Lima"),
    ("a b c d e", "e d c b a"),
    ("the cat", "The cat sat on the mat."),  # precision 1, recall 1/3
])
def test_rouge_l_is_the_lcs_f_measure(prediction, reference):
    assert score("rouge_l", [prediction], [reference])[0] == pytest.approx(_lcs_f1(prediction, reference), abs=1e-12)


def test_metric_lists_and_names():
    from ftctl.config.eval_sets import EVAL_METRICS
    from ftctl.evaluation.scoring import GRADED, METRICS, PERPLEXITY, choose_metrics

    assert set(EVAL_METRICS) == {"auto", *METRICS, *GRADED, PERPLEXITY}
    assert choose_metrics("auto, rouge_l,perplexity,json_match", ['{"a": 1}']) == ["json_match", "rouge_l", "perplexity"]
    with pytest.raises(ConfigError, match="unknown metric 'rouge'. Did you mean 'rouge_l'"):
        choose_metrics("exact_match,rouge", ["x"])


def test_eval_sets_config_shapes_and_mistakes(tmp_path):
    """data.eval_sets: a flow mapping, dotted keys, a config file's mapping; wrong names and fields are one line."""
    from ftctl.config.compose import compose_config
    from ftctl.config.eval_sets import named_eval_sets

    base = ["recipe=tiny_lora", "precision=fp32"]
    cfg = compose_config(base + ["data.eval_sets={orders: a.jsonl, chat: {path: b/, format: sharegpt, metric: perplexity}}"])
    sets = named_eval_sets(cfg.data.eval_sets)
    assert list(sets) == ["orders", "chat"] and sets["orders"].path == "a.jsonl" and sets["orders"].metric == "auto"
    assert (sets["chat"].path, sets["chat"].format, sets["chat"].metric) == ("b/", "sharegpt", "perplexity")
    cfg = compose_config(base + ["data.eval_sets.orders=a.jsonl", "data.eval_sets.chat.path=b.jsonl"])
    assert cfg.data.eval_sets == {"orders": "a.jsonl", "chat": {"path": "b.jsonl"}}
    config = tmp_path / "my.yaml"
    config.write_text("defaults:\n  - override /model: tiny_llama\n  - override /data: alpaca_sample\ndata:\n  eval_sets:\n    orders: a.jsonl\n"
                      "    chat:\n      path: b.jsonl\n      format: sharegpt\n")
    # The file's paths are relative to the file; the command line's stay as typed.
    assert compose_config(["precision=fp32", "data.eval_sets.x=c.jsonl"], str(config)).data.eval_sets == {
        "orders": str(tmp_path / "a.jsonl"), "chat": {"path": str(tmp_path / "b.jsonl"), "format": "sharegpt"}, "x": "c.jsonl"}
    from ftctl.evaluation.evaluate import request_from_overrides

    req = request_from_overrides(["adapter=runs/x", "metric=rouge_l"], str(config))  # ftctl eval --config FILE
    assert req.model is None and req.data_path is None and req.metric == "rouge_l"
    assert {name: (s.path, s.format) for name, s in req.eval_sets.items()} == {
        "orders": (str(tmp_path / "a.jsonl"), None), "chat": (str(tmp_path / "b.jsonl"), "sharegpt")}
    for override, message in [
        ("data.eval_sets={chat: {path: b.jsonl, fromat: sharegpt}}", r"data.eval_sets.chat.fromat: not a field of an eval set. Did you mean 'format'"),
        ("data.eval_sets={chat: {format: sharegpt}}", r"data.eval_sets.chat.path has no value"),
        ("data.eval_sets={eval: a.jsonl}", r"data.eval_sets.eval: a set's name .* not 'eval'"),
        ("data.eval_sets={chat: {path: a.jsonl, metric: bleu}}", r"data.eval_sets.chat.metric: unknown metric 'bleu'"),
    ]:
        with pytest.raises(ConfigError, match=message):
            compose_config(base + [override])


def test_best_metric_must_be_logged_by_the_run(tmp_path, capsys):
    from ftctl.cli import main
    from ftctl.config.compose import compose_config
    from ftctl.config.eval_sets import training_eval_keys
    from ftctl.paths import samples_dir

    base = ["recipe=tiny_lora", "precision=fp32", "train.keep_best=true"]
    sets = "data.eval_sets={orders: a.jsonl, chat: {path: b.jsonl, metric: 'rouge_l,perplexity'}}"
    cfg = compose_config(base + [sets, "data.eval_fraction=0.1", "train.best_metric=eval/chat_perplexity"])
    assert training_eval_keys(cfg.data) == ["eval_loss", "eval/orders_loss", "eval/chat_loss", "eval/chat_perplexity"]
    for overrides, message in [
        ([], r"train.keep_best compares evals, but the run has no eval data"),
        ([sets], r"train.best_metric=eval_loss is not logged by this run.*It logs: eval/orders_loss, eval/chat_loss, eval/chat_perplexity"),
        ([sets, "train.best_metric=eval/orders_los"], r"Did you mean 'eval/orders_loss'"),
        ([sets, "train.best_metric=eval/orders_perplexity"], r"add perplexity to data.eval_sets.orders.metric"),
        ([sets, "train.best_metric=eval/chat_rouge_l"], r"generation metrics are scored by `ftctl eval`"),
        ([sets, "train.keep_best=false", "train.early_stopping_patience=-1"], r"early_stopping_patience=-1 must be >= 0"),
    ]:
        with pytest.raises(ConfigError, match=message):
            compose_config(base + overrides)
    # The plan names what a run logs and compares; a missing set is refused before anything loads.
    train = ["train", "recipe=tiny_lora", "precision=fp32", "train.keep_best=true", "train.best_metric=eval/orders_loss",
             "train.eval_every=10", f"output_dir={tmp_path / 'run'}"]
    assert main(train + [f"data.eval_sets={{orders: {samples_dir() / 'alpaca_sample.jsonl'}}}", "--dry-run"]) == 0
    assert "evals      eval/orders_loss every 10 steps and at the end; best/ by eval/orders_loss" in capsys.readouterr().out
    assert main(train + [f"data.eval_sets={{orders: {tmp_path / 'nope.jsonl'}}}", "--dry-run"]) == 1
    assert f"data.eval_sets.orders.path={tmp_path / 'nope.jsonl'}: no such file" in capsys.readouterr().err


def test_perplexity_is_the_trained_tokens_cross_entropy(tiny_lm, tmp_path):
    """Perplexity over exactly the answer tokens training trains, checked against transformers' own loss per example."""
    import math

    import torch

    from ftctl.config.schema import DataConfig
    from ftctl.data.render import tokenize_conversation
    from ftctl.data.sources import locate, read_source
    from ftctl.evaluation.perplexity import perplexity

    model, tokenizer = tiny_lm
    data = tmp_path / "held.jsonl"
    _write_alpaca(data, [("Add the two numbers.", "41"), ("Reverse the word. stressed", "desserts"),
                         ("Give the plural of 'mouse'.", "The plural of mouse is mice, not mouses.")])
    source = locate(str(data))
    records = read_source(source)
    cfg = DataConfig(format="alpaca", system_prompt="Be terse.")
    measured = perplexity(model, tokenizer, records, source, "alpaca", cfg, batch_size=2)
    nll, tokens = 0.0, 0
    for record in records:
        messages = [{"role": "system", "content": "Be terse."}, {"role": "user", "content": record.data["instruction"]},
                    {"role": "assistant", "content": record.data["output"]}]
        example = tokenize_conversation(messages, tokenizer, cfg.max_seq_len)
        labels = torch.tensor([example.labels])
        with torch.no_grad():
            loss = model(input_ids=torch.tensor([example.input_ids]), labels=labels).loss
        n = int((labels[0, 1:] != -100).sum())
        nll, tokens = nll + float(loss) * n, tokens + n
    assert measured.tokens == tokens and measured.examples == 3
    assert measured.loss == pytest.approx(nll / tokens, rel=1e-5)
    assert measured.perplexity == pytest.approx(math.exp(nll / tokens), rel=1e-5)
    assert perplexity(model, tokenizer, records, source, "alpaca", cfg, batch_size=3).loss == pytest.approx(measured.loss, rel=1e-6)


def test_eval_sets_from_a_directory_and_a_saved_dataset_with_every_metric(tiny_lm, tiny_model_dir, tmp_path, capsys):
    """Named sets of other source kinds, each with its own metrics; eval.json has one summary per set."""
    import datasets

    from ftctl.cli import main
    from ftctl.evaluation.generation import generate

    model, tokenizer = tiny_lm
    instructions = ["Reverse the word.", "Add the two numbers.", "Give the plural of 'cat'."]
    answers = generate(model, tokenizer, [[{"role": "user", "content": i}] for i in instructions], max_new_tokens=5)
    (tmp_path / "dir").mkdir()
    _write_alpaca(tmp_path / "dir" / "b.jsonl", list(zip(instructions[1:], answers[1:])))
    _write_alpaca(tmp_path / "dir" / "a.jsonl", [(instructions[0], answers[0])])  # read first: files in name order
    rows = [{"instruction": i, "output": "zebra " + a} for i, a in zip(instructions, answers)]
    datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:1]), "test": datasets.Dataset.from_list(rows)}).save_to_disk(
        str(tmp_path / "saved"))
    out = tmp_path / "eval"
    sets = f"data.eval_sets={{own: {{path: {tmp_path / 'dir'}, metric: 'exact_match,rouge_l'}}, other: {{path: {tmp_path / 'saved'}, metric: rouge_l}}}}"
    assert main(["eval", f"model={tiny_model_dir}", sets, f"output={out}", "max_new_tokens=5"]) == 0
    result = json.loads((out / "eval.json").read_text())
    own, other = result["sets"]["own"], result["sets"]["other"]
    # rouge-score's tokenizer keeps ASCII letters and digits only, so even an exact answer made of other characters scores 0.
    own_rouge = sum(_lcs_f1(a, a) for a in answers) / 3
    assert own["metrics"] == {"exact_match": 1.0, "rouge_l": pytest.approx(own_rouge)} and own["n"] == 3 and own["correct"] == 3
    expected = [_lcs_f1(a, "zebra " + a) for a in answers]
    assert other["n"] == 3 and other["metrics"]["rouge_l"] == pytest.approx(sum(expected) / 3) and "correct" not in other
    assert [json.loads(line)["reference"] for line in (out / "predictions-own.jsonl").read_text().splitlines()] == answers
    printed = capsys.readouterr().out
    assert f"eval own: exact_match 1.000 (3/3), rouge_l {own_rouge:.3f}" in printed and "eval other: rouge_l" in printed
    # The split of a saved dataset dict: data.split picks train (one row) over the default test.
    assert main(["eval", f"model={tiny_model_dir}", f"data.path={tmp_path / 'saved'}", "data.split=train", f"output={out}",
                 "max_new_tokens=5", "metric=exact_match,perplexity"]) == 0
    summary = json.loads((out / "eval.json").read_text())
    assert summary["n"] == 1 and list(summary["metrics"]) == ["exact_match", "perplexity"] and summary["perplexity"]["examples"] == 1


def test_harness_task_from_a_local_yaml_runs_offline_on_the_adapted_model(tiny_model_dir, tmp_path, monkeypatch, capsys):
    """lm-eval's multiple-choice accuracy on a task defined in the test, on an adapter merged in memory: each
    choice's log-likelihood is the adapted model's (computed here), not the base model's."""
    import datasets
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ftctl.cli import main

    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", str(tmp_path / "datasets_cache"))
    tasks = tmp_path / "tasks"
    tasks.mkdir()
    docs = [{"question": f"What is {i} plus {i}?", "choices": [str(2 * i), str(2 * i + 1), "blue"], "label": i % 3} for i in range(6)]
    (tasks / "sums.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    (tasks / "sums.yaml").write_text(
        f"task: tiny_sums\ndataset_path: json\ndataset_kwargs:\n  data_files:\n    test: {tasks / 'sums.jsonl'}\n"
        "test_split: test\noutput_type: multiple_choice\ndoc_to_text: \"Q: {{question}}\\nA:\"\n"
        "doc_to_choice: \"{{choices}}\"\ndoc_to_target: label\nmetric_list:\n  - metric: acc\nmetadata:\n  version: 1.0\n")
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    torch.manual_seed(0)
    adapter = tmp_path / "run" / "final"
    get_peft_model(base, LoraConfig(r=4, lora_alpha=64, target_modules="all-linear", init_lora_weights=False)).save_pretrained(adapter)

    out = tmp_path / "eval"
    assert main(["eval", f"adapter={adapter}", "harness=tiny_sums", f"harness_include={tasks}", f"output={out}"]) == 0
    samples = [json.loads(line) for line in (out / "harness_samples.jsonl").read_text().splitlines()]
    assert len(samples) == 6

    from ftctl.evaluation.evaluate import load_model

    adapted, tokenizer = load_model(None, adapter)
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)

    def loglikelihood(model, context: str, continuation: str) -> float:
        context_ids, whole = tokenizer(context).input_ids, tokenizer(context + continuation).input_ids
        with torch.no_grad():
            logprobs = torch.log_softmax(model(torch.tensor([whole])).logits[0].double(), -1)
        return float(sum(logprobs[t - 1, whole[t]] for t in range(len(context_ids), len(whole))))

    correct = 0
    for sample in samples:
        doc = docs[sample["doc_id"]]
        context = f"Q: {doc['question']}\nA:"
        mine = [loglikelihood(adapted, context, " " + c) for c in doc["choices"]]
        assert [r[0] for r in sample["filtered_resps"]] == pytest.approx(mine, abs=2e-3)
        assert [loglikelihood(plain, context, " " + c) for c in doc["choices"]] != pytest.approx(mine, abs=2e-3)
        correct += int(max(range(3), key=mine.__getitem__) == doc["label"])
    result = json.loads((out / "eval.json").read_text())
    assert result["harness"]["tiny_sums"]["acc,none"] == pytest.approx(correct / 6)
    assert f"eval harness tiny_sums: acc,none {correct / 6:.4g}" in capsys.readouterr().out
    assert json.loads((out / "harness.json").read_text())["results"]["tiny_sums"]["acc,none"] == pytest.approx(correct / 6)

    assert main(["eval", f"adapter={adapter}", "harness=tiny_sum", f"harness_include={tasks}", f"output={out}"]) == 1
    assert "harness=tiny_sum: not among the task YAML files" in capsys.readouterr().err
