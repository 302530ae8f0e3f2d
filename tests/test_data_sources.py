"""Data as users have it: directories, save_to_disk datasets, hub datasets (offline, from the real datasets
cache), mixtures by weight, plain text, chat templates by name; driven through the CLI where a user would."""

from __future__ import annotations

import json
import re
import time
from pathlib import Path

import numpy as np
import pytest

from ftctl.cli import main, setup_logging
from ftctl.data.render import IGNORE_INDEX

ALPACA = [{"instruction": f"Say {i}", "output": f"number {i}"} for i in range(6)]
CHAT = {"conversations": [{"from": "human", "value": "Ping?"}, {"from": "gpt", "value": "Pong."}]}


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def preview(capsys, model_dir, *overrides: str, n: int = 3):
    """`ftctl data preview` as a user runs it: (exit code, stdout, stderr)."""
    rc = main(["data", "preview", "recipe=tiny_lora", f"model.name_or_path={model_dir}", *overrides, f"n={n}"])
    out = capsys.readouterr()
    return rc, out.out, out.err


def shown_examples(stdout: str):
    return re.findall(r"--- example \d+: \d+ tokens, \d+ trained ---\n(.*?)\n(?=\n--- example|\Z)", stdout, re.S)


def build_hub_cache(cache: Path, repo_id: str, files: dict, commit: str = "0" * 40) -> None:
    """Prepare ``repo_id`` in the datasets cache exactly as loading it from the Hub does (same builder,
    same org___name/config/version/commit layout), from a local script-less repo of data files."""
    from datasets.load import LocalDatasetModuleFactory, get_dataset_builder_class

    repo = cache.parent / "repo" / repo_id
    repo.mkdir(parents=True)
    for name, rows in files.items():
        write_jsonl(repo / name, rows)
    name = repo_id.split("/")[-1]
    module = LocalDatasetModuleFactory(str(repo)).get_module()
    builder = get_dataset_builder_class(module, dataset_name=name)(
        cache_dir=str(cache), hash=commit, **{**module.builder_kwargs, "dataset_name": name}
    )
    # The Hub loader names the builder by its repo (which its __init__ checks the files belong to).
    builder.repo_id = repo_id
    builder._cache_dir = builder._build_cache_dir()
    builder.download_and_prepare()


# --- sources ----------------------------------------------------------------------------------------

def test_a_directory_of_files_is_read_in_name_order(tmp_path, tiny_model_dir, capsys):
    folder = tmp_path / "data"
    folder.mkdir()
    write_jsonl(folder / "b.jsonl", ALPACA[3:])
    (folder / "a.json").write_text(json.dumps(ALPACA[:3]))
    (folder / "notes.txt").write_text("not data")
    rc, out, err = preview(capsys, tiny_model_dir, f"data.path={folder}", n=6)
    assert rc == 0, err
    assert out.startswith(f"6 examples from {folder} (format alpaca; data.format=auto: its first record has 'instruction', 'output')")
    assert [re.search(r"Say (\d)", e).group(1) for e in shown_examples(out)] == ["0", "1", "2", "3", "4", "5"]
    empty = tmp_path / "empty"
    empty.mkdir()
    rc, _, err = preview(capsys, tiny_model_dir, f"data.path={empty}")
    assert rc == 1 and err.strip().count("\n") == 0
    assert "the directory holds no .json, .jsonl or .parquet file" in err


def test_save_to_disk_datasets_and_their_splits(tmp_path, tiny_model_dir, capsys):
    import datasets

    datasets.Dataset.from_list(ALPACA[:4]).save_to_disk(str(tmp_path / "saved"))
    rc, out, err = preview(capsys, tiny_model_dir, f"data.path={tmp_path / 'saved'}", n=4)
    assert rc == 0, err
    assert out.startswith("4 examples from") and "number 3" in shown_examples(out)[3]

    datasets.DatasetDict({
        "train": datasets.Dataset.from_list([CHAT] * 3),
        "test": datasets.Dataset.from_list([{"conversations": [{"from": "human", "value": "Odd?"}, {"from": "gpt", "value": "Even."}]}]),
    }).save_to_disk(str(tmp_path / "dict"))
    rc, out, err = preview(capsys, tiny_model_dir, f"data.path={tmp_path / 'dict'}", "data.format=sharegpt", "data.split=test")
    assert rc == 0, err
    assert out.startswith("1 examples from") and "\u27e6Even.<|im_end|>" in out
    # A split it does not have is refused before anything loads, with the ones it has.
    rc = main(["train", "recipe=tiny_lora", f"model.name_or_path={tiny_model_dir}", f"data.path={tmp_path / 'dict'}",
               "data.format=sharegpt", "data.split=validation", "precision=fp32", "--dry-run"])
    err = capsys.readouterr().err
    assert rc == 1 and "has no split 'validation'; set data.split to one of: train, test" in err
    # The same dataset dict as eval data: its test split (data.eval_split) by default.
    from ftctl.config.compose import compose_config
    from ftctl.data.dataset import build_datasets
    from ftctl.models.loading import load_tokenizer

    cfg = compose_config(["recipe=tiny_lora", f"model.name_or_path={tiny_model_dir}", f"data.path={tmp_path / 'dict'}",
                          f"data.eval_path={tmp_path / 'dict'}", "data.format=sharegpt"])
    train, evaluation = build_datasets(cfg.data, load_tokenizer(cfg.model, str(tiny_model_dir)), cfg.seed)
    assert (len(train), len(evaluation)) == (3, 1)
    rc = main(["train", "recipe=tiny_lora", f"model.name_or_path={tiny_model_dir}", f"data.path={tmp_path / 'dict'}",
               f"data.eval_path={tmp_path / 'dict'}", "data.eval_split=dev", "precision=fp32", "--dry-run"])
    assert rc == 1 and "has no split 'dev'; set data.eval_split to one of: train, test" in capsys.readouterr().err


def go_offline(how: str, monkeypatch) -> None:
    from ftctl.data import sources
    from ftctl.models.hub import hub_reachable

    sources._load_hub.cache_clear()
    if how == "HF_HUB_OFFLINE=1":
        monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    else:  # an endpoint nothing answers on stands for a machine without network
        monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
        monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")
        monkeypatch.delenv("HTTPS_PROXY", raising=False)
        monkeypatch.delenv("https_proxy", raising=False)
        hub_reachable.cache_clear()


@pytest.mark.parametrize("offline", ["HF_HUB_OFFLINE=1", "no network"])
def test_a_hub_dataset_is_read_from_the_datasets_cache_offline(offline, tmp_path, tiny_model_dir, capsys, monkeypatch):
    cache = tmp_path / "hf" / "datasets"
    build_hub_cache(cache, "someorg/orders", {"train.jsonl": ALPACA[:5], "test.jsonl": ALPACA[5:]})
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    go_offline(offline, monkeypatch)
    rc, out, err = preview(capsys, tiny_model_dir, "data.path=someorg/orders", n=5)
    assert rc == 0, err
    assert out.startswith("5 examples from someorg/orders") and "number 4" in out
    assert "Using the latest cached version" not in err  # the library's offline notice is not the user's to act on
    rc, out, err = preview(capsys, tiny_model_dir, "data.path=hf://someorg/orders", "data.split=test")
    assert rc == 0, err
    assert out.startswith("1 examples from hf://someorg/orders") and "\u27e6number 5<|im_end|>" in out
    rc, _, err = preview(capsys, tiny_model_dir, "data.path=someorg/orders", "data.subset=nope")
    assert rc == 1 and "holds no subset 'nope' of it; set data.subset to one it holds: default" in err


@pytest.mark.parametrize("offline", ["HF_HUB_OFFLINE=1", "no network"])
def test_an_uncached_hub_dataset_offline_fails_at_once_in_one_line(offline, tmp_path, tiny_model_dir, capsys, monkeypatch):
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "empty_cache"))
    go_offline(offline, monkeypatch)
    start = time.perf_counter()
    rc = main(["train", "recipe=tiny_lora", f"model.name_or_path={tiny_model_dir}", "data.path=someorg/missing", "precision=fp32",
               f"output_dir={tmp_path / 'run'}"])
    elapsed = time.perf_counter() - start
    err = capsys.readouterr().err
    assert rc == 1 and elapsed < 2.0, (rc, elapsed)
    assert err.count("\n") == 1 and err.startswith("ftctl: error: data.path=someorg/missing: the Hub cannot be reached (")
    assert "not in the local datasets cache" in err
    assert not (tmp_path / "run").exists()


def test_a_missing_local_path_is_not_taken_for_a_hub_id(tmp_path, monkeypatch):
    from ftctl.data.sources import locate
    from ftctl.errors import FtctlError

    monkeypatch.chdir(tmp_path)
    (tmp_path / "data").mkdir()
    for value in ("data/trian.jsonl", "data/orders", "nowhere/train.parquet"):
        with pytest.raises(FtctlError, match=f"data.path={value}: no such file or directory"):
            locate(value)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_CACHE", str(tmp_path / "cache"))
    with pytest.raises(FtctlError, match=r"data.path=hf://data/orders: the Hub cannot be reached"):
        locate("hf://data/orders")  # hf:// always means the Hub


def test_the_cache_key_covers_each_kind_of_source(tmp_path, tiny_model_dir):
    import datasets
    from transformers import AutoTokenizer

    from ftctl.config.schema import DataConfig
    from ftctl.data.dataset import load_or_tokenize

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    cfg = DataConfig(format="alpaca", max_seq_len=64, cache_dir=str(tmp_path / "cache"))
    folder = tmp_path / "folder"
    folder.mkdir()
    write_jsonl(folder / "a.jsonl", ALPACA[:2])
    assert load_or_tokenize(str(folder), cfg, tokenizer).stats["cache"] == "miss"
    assert load_or_tokenize(str(folder), cfg, tokenizer).stats["cache"] == "hit"
    write_jsonl(folder / "b.jsonl", ALPACA[2:3])  # a file added to the directory
    assert len(load_or_tokenize(str(folder), cfg, tokenizer)) == 3
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ALPACA[:2]), "test": datasets.Dataset.from_list(ALPACA[2:])}).save_to_disk(
        str(tmp_path / "dict"))
    train = load_or_tokenize(str(tmp_path / "dict"), cfg, tokenizer)
    test = load_or_tokenize(str(tmp_path / "dict"), DataConfig(**{**cfg.__dict__, "split": "test"}), tokenizer)
    assert (len(train), len(test), test.stats["cache"]) == (2, 4, "miss")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(ALPACA[:3]), "test": datasets.Dataset.from_list(ALPACA[3:])}).save_to_disk(
        str(tmp_path / "dict"))  # saved again with other content
    changed = load_or_tokenize(str(tmp_path / "dict"), cfg, tokenizer)
    assert (len(changed), changed.stats["cache"]) == (3, "miss")


# --- mixtures -----------------------------------------------------------------------------------------

def test_the_mixture_sampler_gives_every_source_its_share_and_depends_on_the_step_alone():
    from ftctl.data.batching import MixtureSampler, mixture_quotas

    assert mixture_quotas([10, 30], [1, 1]) == [20, 20]
    assert mixture_quotas([90, 10], [3, 1]) == [75, 25]
    assert mixture_quotas([1000, 2], [1000, 1]) == [1001, 1]  # a listed source always trains
    sizes, weights, batch = [12, 5, 40], [2.0, 1.0, 1.0], 8
    sampler = MixtureSampler(sizes, weights, batch, seed=7)
    n = sum(sizes)
    starts = np.cumsum([0] + sizes[:-1])
    for epoch in range(3):
        order = sampler._epoch_order(epoch)
        source_of = np.searchsorted(starts, order, side="right") - 1
        assert np.bincount(source_of, minlength=3).tolist() == mixture_quotas(sizes, weights) == [29, 14, 14]
    # Source 1 (5 examples, 14 per epoch) is repeated: every example equally often, give or take one.
    seen = np.concatenate([sampler._epoch_order(e) for e in range(5)])
    counts = np.bincount(seen[(seen >= 12) & (seen < 17)] - 12)
    assert counts.max() - counts.min() <= 1
    # Source 2 (40 examples, 14 per epoch) is read further each epoch, not from its start again.
    first_two = np.concatenate([sampler._epoch_order(e) for e in range(2)])
    assert len(set(first_two[first_two >= 17].tolist())) == 28
    # A resumed run builds a fresh sampler: the batch of every step is the same.
    again = MixtureSampler(sizes, weights, batch, seed=7)
    for step in (0, 3, 7, 13, 20):
        assert again.global_batch(step) == sampler.global_batch(step)
    assert MixtureSampler(sizes, weights, batch, seed=8).global_batch(0) != sampler.global_batch(0)
    assert sum(len(sampler.global_batch(s)) for s in range(n // batch)) == n // batch * batch
    # Unshuffled (data.shuffle=false): each source in its order, interleaved evenly; the small one wraps around.
    assert MixtureSampler([4, 2], [1, 1], 2, seed=0, shuffle=False)._epoch_order(0).tolist() == [0, 4, 1, 5, 2, 4]


def test_a_mixture_trains_each_source_in_its_format_logs_the_shares_and_resumes_exactly(
    tmp_path, tiny_model_dir, make_cfg, run_training, capsys, monkeypatch
):
    alpaca = write_jsonl(tmp_path / "a.jsonl", ALPACA)
    chats = write_jsonl(tmp_path / "c.jsonl", [CHAT, {"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Yo"}]}])
    mixture = f"data.mixture=[{{path:{alpaca},weight:3}},{{path:{chats},format:sharegpt,weight:1}}]"
    rc, out, err = preview(capsys, tiny_model_dir, mixture, n=8)
    assert rc == 0, err
    assert out.startswith(f"8 examples from a mixture of 75.0% {alpaca}: alpaca (data.format=auto: its first record has 'instruction', "
                          f"'output'), weight 3, 6 examples; 25.0% {chats}: sharegpt, weight 1, 2 examples")
    examples = shown_examples(out)
    assert sum("Say" in e for e in examples) == 6 and sum("\u27e6Pong.<|im_end|>" in e or "\u27e6Yo<|im_end|>" in e for e in examples) == 2

    rc = main(["train", "recipe=tiny_lora", f"model.name_or_path={tiny_model_dir}", mixture, "precision=fp32", "--dry-run"])
    out = capsys.readouterr().out
    assert rc == 0 and f"data       mixture of 75% auto {alpaca}, 25% sharegpt {chats}" in out

    # Trained with weights against the sizes (6 alpaca, 2 chat examples): 1:3 gives each epoch of 8 examples
    # 2 alpaca and 6 chat ones, which a sampler ignoring the weights (6:2) would not.
    mixture = f"data.mixture=[{{path:{alpaca},weight:1}},{{path:{chats},format:sharegpt,weight:3}}]"
    common = ("precision=fp32", mixture, "train.max_steps=4", "train.save_every=2", "train.global_batch_size=4", "train.micro_batch_size=2")
    setup_logging()  # the run's log to stdout, as the CLI has it
    from ftctl.training import runner

    trained_examples, sampler_for = [], runner.sampler_for

    def recording_sampler(*args, **kwargs):
        sampler = sampler_for(*args, **kwargs)
        rank_share = sampler.rank_share
        sampler.rank_share = lambda step, rank, world: trained_examples.extend(rank_share(step, rank, world)) or rank_share(step, rank, world)
        return sampler

    monkeypatch.setattr(runner, "sampler_for", recording_sampler)
    full, full_metrics = run_training(make_cfg(*common))
    log = capsys.readouterr().out
    assert f"data mixture, each epoch's share: 25.0% {alpaca}: alpaca (data.format=auto: its first record has 'instruction', 'output'), " \
           f"weight 1, 6 examples; 75.0% {chats}: sharegpt, weight 3" in log
    # Two epochs (4 steps of 4): the chat examples (dataset indices 6 and 7) trained 12 times of 16, each 6 times.
    assert len(trained_examples) == 16 and trained_examples.count(6) == trained_examples.count(7) == 6
    resumed_cfg = make_cfg(*common, f"output_dir={tmp_path / 'resumed'}", "resume=checkpoints")
    resumed_cfg.resume = str(full.run_dir / "checkpoints" / "step-2")
    _, resumed_metrics = run_training(resumed_cfg)
    losses = lambda metrics: {m["step"]: m["loss"] for m in metrics if "loss" in m}  # noqa: E731
    assert losses(resumed_metrics) == {s: l for s, l in losses(full_metrics).items() if s > 2}


def test_mixture_entries_are_checked_before_anything_loads(tmp_path, tiny_model_dir, capsys):
    alpaca = write_jsonl(tmp_path / "a.jsonl", ALPACA)
    base = ["train", "recipe=tiny_lora", f"model.name_or_path={tiny_model_dir}", "precision=fp32"]
    assert main([*base, f"data.mixture=[{{path:{alpaca},weight:0}}]", "--dry-run"]) == 2
    assert "data.mixture[0].weight=0.0 must be > 0" in capsys.readouterr().err
    assert main([*base, f"data.mixture=[{{path:{alpaca}}},{{path:{tmp_path / 'nope.jsonl'}}}]", "--dry-run"]) == 1
    assert f"data.mixture[1].path={tmp_path / 'nope.jsonl'}: no such file or directory" in capsys.readouterr().err
    assert main([*base, f"data.mixture=[{{path:{alpaca},format:alpacca}}]", "--dry-run"]) == 2
    assert "unknown data.format 'alpacca'. Did you mean 'alpaca'?" in capsys.readouterr().err


# --- plain text ----------------------------------------------------------------------------------------

def test_text_format_trains_every_token_and_splits_long_documents(tmp_path, tiny_model_dir, capsys):
    from transformers import AutoTokenizer

    from ftctl.config.schema import DataConfig
    from ftctl.data.dataset import load_or_tokenize

    short, long = "A short note.", " ".join(f"word{i}" for i in range(60))
    path = write_jsonl(tmp_path / "corpus.jsonl", [{"text": short, "meta": "x"}, {"text": long}])
    rc, out, err = preview(capsys, tiny_model_dir, f"data.path={path}", "data.format=text", "data.max_seq_len=32", n=1)
    assert rc == 0, err
    # No chat template: the document as it is, every token after the first trained, ending in EOS.
    assert shown_examples(out)[0] == "A\u27e6 short note.<|im_end|>\u27e7"
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    data = load_or_tokenize(path, DataConfig(format="text", max_seq_len=32, cache_dir=str(tmp_path / "cache")), tokenizer)
    long_ids = tokenizer(long)["input_ids"] + [tokenizer.eos_token_id]
    pieces = [data[i] for i in range(1, len(data))]
    assert len(pieces) > 1 and all(len(ids) <= 32 for ids, _ in pieces) and data.stats["split_documents"] == 1
    # Consecutive pieces overlap by one token, so every token of the document but its first is a target once.
    targets = [token for ids, labels in pieces for token, label in list(zip(ids, labels))[1:] if label != IGNORE_INDEX]
    assert targets == long_ids[1:]
    bad = write_jsonl(tmp_path / "bad.jsonl", [{"content": "x"}])
    rc, _, err = preview(capsys, tiny_model_dir, f"data.path={bad}", "data.format=text")
    assert rc == 1 and "bad.jsonl:1: not a valid 'text' record: missing required field 'text'" in err
    rc, _, err = preview(capsys, tiny_model_dir, f"data.path={path}", "data.format=alpaca")
    assert rc == 1 and err.strip().endswith("The record reads as data.format=text.")
    rc, out, err = preview(capsys, tiny_model_dir, f"data.path={path}", "data.max_seq_len=32", n=1)  # data.format=auto
    assert rc == 0 and f"{path} (format text; data.format=auto: its first record has 'text')" in out, err


# --- chat templates by name ------------------------------------------------------------------------------

CONVERSATION = [
    {"role": "system", "content": "Be terse."}, {"role": "user", "content": "2x3?"}, {"role": "assistant", "content": "6"},
    {"role": "user", "content": "cat reversed?"}, {"role": "assistant", "content": "tac"},
]
#: The canonical rendering of each family (no BOS: the tiny tokenizer has none).
CANONICAL = {
    "chatml": "<|im_start|>system\nBe terse.<|im_end|>\n<|im_start|>user\n2x3?<|im_end|>\n<|im_start|>assistant\n6<|im_end|>\n"
              "<|im_start|>user\ncat reversed?<|im_end|>\n<|im_start|>assistant\ntac<|im_end|>\n",
    "llama3": "<|start_header_id|>system<|end_header_id|>\n\nBe terse.<|eot_id|><|start_header_id|>user<|end_header_id|>\n\n2x3?<|eot_id|>"
              "<|start_header_id|>assistant<|end_header_id|>\n\n6<|eot_id|><|start_header_id|>user<|end_header_id|>\n\ncat reversed?<|eot_id|>"
              "<|start_header_id|>assistant<|end_header_id|>\n\ntac<|eot_id|>",
    "mistral": "[INST] Be terse.\n\n2x3? [/INST]6<|endoftext|>[INST] cat reversed? [/INST]tac<|endoftext|>",
    "gemma": "<start_of_turn>user\nBe terse.\n\n2x3?<end_of_turn>\n<start_of_turn>model\n6<end_of_turn>\n"
             "<start_of_turn>user\ncat reversed?<end_of_turn>\n<start_of_turn>model\ntac<end_of_turn>\n",
    "phi3": "<|system|>\nBe terse.<|end|>\n<|user|>\n2x3?<|end|>\n<|assistant|>\n6<|end|>\n<|user|>\ncat reversed?<|end|>\n<|assistant|>\ntac<|end|>\n",
    "alpaca": "Be terse.\n\n### Instruction:\n2x3?\n\n### Response:\n6<|endoftext|>\n\n### Instruction:\ncat reversed?\n\n### Response:\ntac<|endoftext|>\n\n",
}
GENERATION_PROMPT = {"chatml": "<|im_start|>assistant\n", "llama3": "<|start_header_id|>assistant<|end_header_id|>\n\n",
                     "mistral": " [/INST]", "gemma": "<start_of_turn>model\n", "phi3": "<|assistant|>\n", "alpaca": "### Response:\n"}
END_OF_TURN = {"chatml": "<|im_end|>", "llama3": "<|eot_id|>", "mistral": "<|endoftext|>", "gemma": "<end_of_turn>",
               "phi3": "<|end|>", "alpaca": "<|endoftext|>"}


@pytest.fixture(scope="module")
def plain_tokenizer(tiny_model_no_template_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_no_template_dir)


@pytest.mark.parametrize("name", sorted(CANONICAL))
def test_named_templates_render_their_family_and_mark_the_answers(name, plain_tokenizer):
    from ftctl.data.chat_templates import CHAT_TEMPLATES
    from ftctl.data.render import ensure_chat_template, tokenize_conversation

    assert sorted(CHAT_TEMPLATES) == sorted(CANONICAL)
    tok = plain_tokenizer
    previous = tok.chat_template
    try:
        ensure_chat_template(tok, name)
        assert tok.apply_chat_template(CONVERSATION, tokenize=False) == CANONICAL[name]
        prompt = tok.apply_chat_template(CONVERSATION[:2], tokenize=False, add_generation_prompt=True)
        assert prompt.endswith(GENERATION_PROMPT[name]) and "2x3?" in prompt
        # {% generation %} marks each answer with its end-of-turn marker (transformers' assistant mask) ...
        marked = tok.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        generated = _runs(marked["input_ids"], marked["assistant_masks"], tok)
        assert generated == ["6" + END_OF_TURN[name], "tac" + END_OF_TURN[name]]
        # ... and ftctl trains exactly those answers, the whitespace before the next turn, and one final EOS.
        example = tokenize_conversation(CONVERSATION, tok, max_seq_len=512)
        trained = _runs(example.input_ids, [label != IGNORE_INDEX for label in example.labels], tok)
        assert len(trained) == 2 and trained[-1].count(tok.eos_token) == 1
        for answer, span in zip(generated, trained):
            assert span.startswith(answer) and span[len(answer):].replace(tok.eos_token, "").strip() == ""
    finally:
        tok.chat_template = previous


def _runs(ids, flags, tok):
    runs, current = [], []
    for token, flag in zip(ids, flags):
        if flag:
            current.append(token)
        elif current:
            runs.append(tok.decode(current))
            current = []
    return runs + ([tok.decode(current)] if current else [])


def test_chatml_by_name_trains_the_answer_and_its_end_marker(tiny_model_no_template_dir, capsys):
    # The bug this fixes: the word "chatml" taken as a template rendered every example as the text "chatml".
    rc, out, err = preview(capsys, tiny_model_no_template_dir, "data.chat_template=chatml", n=1)
    assert rc == 0, err
    example = shown_examples(out)[0]
    assert example.startswith("<|im_start|>system\nAnswer with a JSON object.<|im_end|>\n<|im_start|>user\n")
    trained = re.findall("\u27e6(.*?)\u27e7", example, re.S)
    assert trained == ['{"colour": "green", "animal": "cat"}<|im_end|><|endoftext|>']  # EOS right after the end of turn


def test_a_run_with_a_named_template_trains_whole_answers_and_saves_the_template(tiny_model_no_template_dir, make_cfg,
                                                                                 run_training, capsys):
    from ftctl.data.chat_templates import CHAT_TEMPLATES

    setup_logging()  # the run's log to stdout, as the CLI has it
    result, metrics = run_training(make_cfg("precision=fp32", "train.max_steps=2", "data.chat_template=chatml",
                                            model_dir=tiny_model_no_template_dir))
    examples, trained = map(int, re.search(r"data: (\d+) train examples \((\d+) trained tokens\)", capsys.readouterr().out).groups())
    assert trained > 3 * examples  # whole answers, not the one EOS after the word "chatml"
    assert (result.final_dir / "chat_template.jinja").read_text() == CHAT_TEMPLATES["chatml"]
    assert all(np.isfinite(m["loss"]) for m in metrics if "loss" in m)


def test_a_template_value_that_is_no_name_jinja_or_file_is_refused_with_the_names(tmp_path, tiny_model_dir, capsys):
    base = ["train", "recipe=tiny_lora", f"model.name_or_path={tiny_model_dir}", "precision=fp32"]
    assert main([*base, "data.chat_template=chatmll", "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "data.chat_template='chatmll' is not a template name, a Jinja template or an existing .jinja file" in err
    assert "Did you mean 'chatml'? Names: chatml, llama3, mistral, gemma, phi3, alpaca" in err
    template = tmp_path / "mine.jinja"
    template.write_text(CHAT_TEMPLATE_FILE)
    rc, out, err = preview(capsys, tiny_model_dir, f"data.chat_template={template}", n=1)
    assert rc == 0, err
    assert "USER: " in out and "\u27e6" in out
    template.write_text("{% for m in messages %}{{ m['content'] }")
    assert main([*base, f"data.chat_template={template}", "--dry-run"]) == 2
    assert "data.chat_template is not a valid Jinja template" in capsys.readouterr().err


CHAT_TEMPLATE_FILE = (
    "{% for m in messages %}{% if m['role'] == 'assistant' %}{{ 'BOT: ' + m['content'] + eos_token + '\\n' }}"
    "{% else %}{{ m['role'].upper() + ': ' + m['content'] + '\\n' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ 'BOT: ' }}{% endif %}"
)


# --- messages ---------------------------------------------------------------------------------------------

def test_a_malformed_json_line_names_the_real_column(tmp_path, tiny_model_dir, capsys):
    good = json.dumps(ALPACA[0])
    path = tmp_path / "x.jsonl"
    path.write_text(good + "\n" + '{"instruction": "a", "output": "b"\n' + good + "\n")  # the closing brace is missing
    rc, _, err = preview(capsys, tiny_model_dir, f"data.path={path}")
    assert rc == 1
    assert err.strip() == f"ftctl: error: {path}:2: malformed JSON line: Expecting ',' delimiter (column 35, the end of the line)"
    path.write_text('{"instruction": "a" "output": "b"}\n')
    rc, _, err = preview(capsys, tiny_model_dir, f"data.path={path}")
    assert rc == 1 and err.strip().endswith("x.jsonl:1: malformed JSON line: Expecting ',' delimiter (column 21)")
