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
    assert "data.path=FILE" in capsys.readouterr().err
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
    assert req.data_format == "alpaca" and req.n == 5
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
