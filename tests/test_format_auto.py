"""data.format=auto, the default: each file (and each mixture source, and the eval file) is read in the
format its first record shows, and the log says which and why."""

from __future__ import annotations

import json
import logging
from types import SimpleNamespace

import pytest

from ftctl.config.schema import DataConfig, MixtureSource
from ftctl.errors import FtctlError

ALPACA = [{"instruction": f"Say {i}", "input": "", "output": f"number {i}"} for i in range(4)]
SHAREGPT = [{"conversations": [{"from": "human", "value": "Ping?"}, {"from": "gpt", "value": "Pong."}]}]
OPENAI = [{"messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}]}]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def test_auto_is_the_default_and_detects_each_source_with_its_reason(tmp_path, tokenizer, caplog):
    from ftctl.data.dataset import build_datasets, format_summary, load_or_tokenize, tokenize_records
    from ftctl.data.records import read_records
    from ftctl.data.sources import locate

    assert DataConfig().format == "auto"
    alpaca, chats, messages = (write_jsonl(tmp_path / name, rows) for name, rows in
                               (("a.jsonl", ALPACA), ("c.jsonl", SHAREGPT), ("m.jsonl", OPENAI)))
    cfg = DataConfig(path=str(chats), eval_path=str(alpaca), cache_dir=str(tmp_path / "cache"))
    train, evaluation = build_datasets(cfg, tokenizer, seed=0)
    assert format_summary(train.stats) == f"data.path={chats}: sharegpt (data.format=auto: its first record has 'conversations')"
    assert format_summary(evaluation.stats) == (f"data.eval_path={alpaca}: alpaca (data.format=auto: its first record has "
                                                "'instruction', 'output')")
    # The same examples as with the format named; a cache hit still knows what was detected.
    named = tokenize_records(read_records(chats), locate(str(chats)), "sharegpt", cfg, tokenizer)
    assert train.input_ids.tolist() == named.input_ids.tolist() and train.labels.tolist() == named.labels.tolist()
    again = load_or_tokenize(str(chats), cfg, tokenizer)
    assert again.stats["cache"] == "hit" and again.stats["format_detected"] == "its first record has 'conversations'"
    # Several formats read OpenAI messages: the first by name, and the log says the other one would too.
    assert load_or_tokenize(str(messages), cfg, tokenizer).stats["format_detected"] == (
        "its first record has 'messages'; it reads as sharegpt too")
    assert load_or_tokenize(str(messages), cfg, tokenizer).stats["format"] == "openai"

    mixed = DataConfig(mixture=[MixtureSource(path=str(alpaca), weight=3), MixtureSource(path=str(chats))],
                       cache_dir=str(tmp_path / "cache"))
    combined, _ = build_datasets(mixed, tokenizer, seed=0)
    assert [(part["format"], part["format_detected"]) for part in combined.stats["mixture"]] == [
        ("alpaca", "its first record has 'instruction', 'output'"), ("sharegpt", "its first record has 'conversations'")]

    from ftctl.data.dataset import build_eval_sets
    from ftctl.training.evals import RunEvals
    from ftctl.training.runner import _log_data

    named = build_eval_sets(DataConfig(eval_sets={"chats": str(messages)}, cache_dir=str(tmp_path / "cache")), tokenizer)
    assert named["chats"].stats["format"] == "openai"  # a named eval set: detected on its own too
    with caplog.at_level(logging.INFO, logger="ftctl"):
        _log_data(SimpleNamespace(is_main=True), train, evaluation, RunEvals(evaluation, named, cfg, 0))
    assert f"data format: data.path={chats}: sharegpt (data.format=auto: its first record has 'conversations')" in caplog.text
    assert f"data format: data.eval_path={alpaca}: alpaca (data.format=auto" in caplog.text
    assert f"data format: data.eval_sets.chats.path={messages}: openai (data.format=auto" in caplog.text


def test_a_record_of_no_known_format_names_its_fields(tmp_path, tokenizer):
    from ftctl.data.dataset import load_or_tokenize

    odd = write_jsonl(tmp_path / "odd.jsonl", [{"question": "a", "answer": "b"}])
    with pytest.raises(FtctlError, match=r"odd\.jsonl:1: data\.format=auto cannot tell the format of a record with the fields "
                                         r"'answer', 'question'; set data\.format to one of alpaca, "):
        load_or_tokenize(str(odd), DataConfig(cache_dir=str(tmp_path / "cache")), tokenizer)
    # A record that looks like a format but breaks it is that format's error, with its line.
    broken = write_jsonl(tmp_path / "broken.jsonl", [{"instruction": "a", "output": 3}])
    with pytest.raises(FtctlError, match=r"broken\.jsonl:1: not a valid 'alpaca' record"):
        load_or_tokenize(str(broken), DataConfig(cache_dir=str(tmp_path / "cache")), tokenizer)
