"""Data formats, chat rendering, prompt masking, EOS handling, truncation, caching and the eval split."""

from __future__ import annotations

import json
from dataclasses import replace

import numpy as np
import pytest

from data_formats import available, get_format
from ftctl.config.schema import DataConfig
from ftctl.data.batching import StepSampler, collate
from ftctl.data.dataset import build_datasets, load_or_tokenize
from ftctl.data.preview import TRAINED_CLOSE, TRAINED_OPEN, mark_spans
from ftctl.data.render import FALLBACK_CHAT_TEMPLATE, IGNORE_INDEX, ensure_chat_template, tokenize_conversation
from ftctl.errors import FtctlError

MULTI_TURN = {
    "conversations": [
        {"from": "system", "value": "Be terse."},
        {"from": "human", "value": "What is 2 times 3?"},
        {"from": "gpt", "value": "6"},
        {"from": "human", "value": "And cat backwards?"},
        {"from": "gpt", "value": "tac"},
    ]
}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.fixture(scope="module")
def plain_tokenizer(tiny_model_no_template_dir):
    from ftctl.config.schema import ModelConfig
    from ftctl.models.loading import load_tokenizer

    tok = load_tokenizer(ModelConfig(name_or_path=str(tiny_model_no_template_dir)), str(tiny_model_no_template_dir))
    ensure_chat_template(tok)
    return tok


def trained_spans(input_ids, labels):
    """Runs of consecutive trained positions, as token-id lists."""
    spans, current = [], []
    for token, label in zip(input_ids, labels):
        if label != IGNORE_INDEX:
            assert label == token, "a trained label must be the token itself"
            current.append(token)
        elif current:
            spans.append(current)
            current = []
    return spans + ([current] if current else [])


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def test_builtin_formats_are_registered():
    assert {"alpaca", "sharegpt", "openai"} <= set(available())


def test_alpaca_record_becomes_a_conversation():
    fmt = get_format("alpaca")
    assert fmt.to_messages({"instruction": "Add.", "input": "1 + 2", "output": "3", "system": "Be exact."}) == [
        {"role": "system", "content": "Be exact."},
        {"role": "user", "content": "Add.\n\n1 + 2"},
        {"role": "assistant", "content": "3"},
    ]
    assert fmt.to_messages({"instruction": "Hi", "input": "", "output": "Hello"})[0] == {"role": "user", "content": "Hi"}


def test_sharegpt_accepts_openai_messages():
    fmt = get_format("sharegpt")
    openai = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}
    assert fmt.to_messages(openai) == [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
    assert get_format("openai").to_messages(openai) == fmt.to_messages(openai)


def test_multi_turn_masks_exactly_the_prompt(tokenizer):
    messages = get_format("sharegpt").to_messages(MULTI_TURN)
    example = tokenize_conversation(messages, tokenizer, max_seq_len=512)
    spans = [tokenizer.decode(s) for s in trained_spans(example.input_ids, example.labels)]
    # Both assistant turns train, each with its end-of-turn token (this tokenizer's EOS), not the newline after it.
    assert spans == ["6<|im_end|>", "tac<|im_end|>"]
    masked = tokenizer.decode([t for t, l in zip(example.input_ids, example.labels) if l == IGNORE_INDEX])
    for prompt_text in ("Be terse.", "What is 2 times 3?", "And cat backwards?", "<|im_start|>assistant\n"):
        assert prompt_text in masked
    eos_positions = [i for i, t in enumerate(example.input_ids) if t == tokenizer.eos_token_id]
    trained_eos = [i for i in eos_positions if example.labels[i] != IGNORE_INDEX]
    assert len(trained_eos) == 2  # the EOS closing each assistant turn
    assert len(eos_positions) == 5  # system and user turns' EOS stay masked


def test_only_assistant_turns_answering_a_user_train(tokenizer):
    record = {"conversations": [
        {"from": "gpt", "value": "Hello, how can I help?"},  # answers nobody: context
        {"from": "human", "value": "Double 3."},
        {"from": "gpt", "value": "5", "weight": 0},  # a wrong answer kept as context (axolotl's weight 0)
        {"from": "human", "value": "Try again."},
        {"from": "gpt", "value": "6"},
    ]}
    messages = get_format("sharegpt").to_messages(record)
    example = tokenize_conversation(messages, tokenizer, max_seq_len=512)
    assert [tokenizer.decode(s) for s in trained_spans(example.input_ids, example.labels)] == ["6<|im_end|>"]
    assert tokenizer.decode(example.input_ids).startswith("<|im_start|>assistant\nHello, how can I help?")
    everything = tokenize_conversation(messages, tokenizer, max_seq_len=512, train_on_prompt=True)
    assert everything.labels == everything.input_ids == example.input_ids
    # A completion prompted by a system turn alone trains.
    prompted = [{"role": "system", "content": "Write a haiku."}, {"role": "assistant", "content": "Leaves"}]
    trained = tokenize_conversation(prompted, tokenizer, max_seq_len=512)
    assert [tokenizer.decode(s) for s in trained_spans(trained.input_ids, trained.labels)] == ["Leaves<|im_end|>"]


def test_a_file_with_nothing_to_train_says_so(tmp_path, tokenizer):
    only_greetings = {"conversations": [{"from": "gpt", "value": "Hi!"}, {"from": "human", "value": "Bye"},
                                        {"from": "gpt", "value": "Ciao", "weight": 0}]}
    path = write_jsonl(tmp_path / "g.jsonl", [only_greetings])
    cfg = DataConfig(format="sharegpt", path=str(path), max_seq_len=64, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(FtctlError, match=r"none has an assistant turn to train \(one after a user or system turn, not marked weight 0\)"):
        load_or_tokenize(path, cfg, tokenizer)
    from ftctl.evaluation.evaluate import held_out_examples

    with pytest.raises(FtctlError, match="no assistant turn after a prompt to score"):
        held_out_examples(path, "sharegpt")
    scored = write_jsonl(tmp_path / "s.jsonl", [{"conversations": [
        {"from": "human", "value": "Double 3."}, {"from": "gpt", "value": "6"},
        {"from": "human", "value": "Thanks"}, {"from": "gpt", "value": "You are welcome", "weight": 0}]}])
    _, examples = held_out_examples(scored, "sharegpt")
    assert examples[0].reference == "6" and len(examples[0].prompt) == 1  # the turn training would train on


def test_openai_content_parts_are_joined_and_non_text_turns_refused():
    openai = get_format("openai")
    parts = [{"type": "text", "text": "Hello "}, {"type": "text", "text": "there"}]
    assert openai.to_messages({"messages": [{"role": "user", "content": parts}, {"role": "assistant", "content": "hi"}]})[0] == {
        "role": "user", "content": "Hello there"}
    from data_formats import FormatError

    with pytest.raises(FormatError, match="turn 1: 'content' is null"):
        openai.to_messages({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "content": None}]})
    with pytest.raises(FormatError, match="content parts of type image_url"):
        openai.to_messages({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]},
                                         {"role": "assistant", "content": "x"}]})


def test_train_on_prompt_trains_everything(tokenizer):
    messages = get_format("sharegpt").to_messages(MULTI_TURN)
    example = tokenize_conversation(messages, tokenizer, max_seq_len=512, train_on_prompt=True)
    assert example.labels == example.input_ids


def test_fallback_template_trains_eos_even_when_pad_is_eos(plain_tokenizer):
    tok = plain_tokenizer
    assert tok.chat_template == FALLBACK_CHAT_TEMPLATE
    assert tok.pad_token_id == tok.eos_token_id  # the dangerous case
    messages = get_format("alpaca").to_messages({"instruction": "Reverse the word.", "input": "cat", "output": "tac"})
    example = tokenize_conversation(messages, tok, max_seq_len=512)
    spans = trained_spans(example.input_ids, example.labels)
    assert len(spans) == 1 and tok.eos_token_id in spans[0]
    assert tok.decode(spans[0][: spans[0].index(tok.eos_token_id)]).strip() == "tac"
    short = tokenize_conversation(
        get_format("alpaca").to_messages({"instruction": "Hi", "output": "yo"}), tok, max_seq_len=512
    )
    batch = collate([(example.input_ids, example.labels), (short.input_ids, short.labels)], tok.pad_token_id)
    row = batch.labels[1]
    n = len(short.input_ids)
    eos_at = short.input_ids.index(tok.eos_token_id)
    assert int(row[eos_at]) == tok.eos_token_id  # the real EOS is still a target...
    assert bool((row[n:] == IGNORE_INDEX).all())  # ...while EOS-valued padding is not
    assert int(batch.attention_mask[1].sum()) == n


def test_multi_turn_works_when_the_tokenizer_merges_across_turn_boundaries(tiny_model_no_template_dir, tmp_path):
    """SmolLM2's tokenizer (and GPT-2's) makes "\n\n" one token at the end of a text and two before "###":
    the fallback template's renderings then do not extend each other as tokens, only as text."""
    from transformers import AutoTokenizer

    from ftctl.data.render import _ids, _turn_pieces

    spec = json.loads((tiny_model_no_template_dir / "tokenizer.json").read_text())
    merges, vocab = spec["model"]["merges"], spec["model"]["vocab"]
    vocab["\u010a\u010a"] = 1 + max([*vocab.values(), *(t["id"] for t in spec["added_tokens"])])
    merges.insert(0, ["\u010a", "\u010a"] if isinstance(merges[0], list) else "\u010a \u010a")
    merging = tmp_path / "merging"
    merging.mkdir()
    for name in ("tokenizer_config.json", "special_tokens_map.json"):
        if (tiny_model_no_template_dir / name).exists():
            (merging / name).write_text((tiny_model_no_template_dir / name).read_text())
    (merging / "tokenizer.json").write_text(json.dumps(spec))
    tok = AutoTokenizer.from_pretrained(merging)
    ensure_chat_template(tok)
    assert tok.tokenize("a\n\n") == ["a", "\u010a\u010a"] and tok.tokenize("a\n\n###")[:3] == ["a", "\u010a", "\u010a"]

    messages = get_format("sharegpt").to_messages(MULTI_TURN)
    assert _turn_pieces(messages, lambda m, gen: _ids(tok, m, gen)) is None  # the token-prefix route fails here
    example = tokenize_conversation(messages, tok, max_seq_len=512)
    spans = [tok.decode(s) for s in trained_spans(example.input_ids, example.labels)]
    assert spans == [f"6{tok.eos_token}", f"tac{tok.eos_token}"]  # the generation blocks: not the "\n\n" after them
    # The whole rendering, but the "\n\n" after the last answer (nothing after it is trained).
    assert tok.decode(example.input_ids) + "\n\n" == tok.apply_chat_template(messages, tokenize=False)


def test_truncation_is_counted_and_fully_masked_examples_dropped(tmp_path, tokenizer):
    rows = [{"instruction": "word " * 40, "output": "yes"}, {"instruction": "Hi", "output": "yo " * 30}]
    cfg = DataConfig(format="alpaca", path=str(write_jsonl(tmp_path / "d.jsonl", rows)), max_seq_len=32,
                     cache_dir=str(tmp_path / "cache"))
    data = load_or_tokenize(cfg.path, cfg, tokenizer)
    assert data.stats["truncated"] == 2
    assert data.stats["dropped_no_trained_tokens"] == 1  # the long prompt left no room for the answer
    assert len(data) == 1 and len(data[0][0]) == 32


def test_every_example_masked_is_an_error(tmp_path, tokenizer):
    cfg = DataConfig(format="alpaca", path=str(write_jsonl(tmp_path / "d.jsonl", [{"instruction": "w " * 50, "output": "x"}])),
                     max_seq_len=16, cache_dir=str(tmp_path / "cache"))
    with pytest.raises(FtctlError, match="every example was filtered out"):
        load_or_tokenize(cfg.path, cfg, tokenizer)


def test_cache_is_keyed_by_content_tokenizer_template_and_settings(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", [{"instruction": "Hi", "output": "yo"}])
    cfg = DataConfig(format="alpaca", path=str(path), max_seq_len=64, cache_dir=str(tmp_path / "cache"))
    assert load_or_tokenize(path, cfg, tokenizer).stats["cache"] == "miss"
    assert load_or_tokenize(path, cfg, tokenizer).stats["cache"] == "hit"
    assert load_or_tokenize(path, replace(cfg, max_seq_len=63), tokenizer).stats["cache"] == "miss"
    assert load_or_tokenize(path, replace(cfg, train_on_prompt=True), tokenizer).stats["cache"] == "miss"
    assert load_or_tokenize(path, replace(cfg, system_prompt="S"), tokenizer).stats["cache"] == "miss"
    write_jsonl(path, [{"instruction": "Hi", "output": "yo!"}])
    changed = load_or_tokenize(path, cfg, tokenizer)
    assert changed.stats["cache"] == "miss"
    original_template = tokenizer.chat_template
    try:
        tokenizer.chat_template = FALLBACK_CHAT_TEMPLATE
        assert load_or_tokenize(path, cfg, tokenizer).stats["cache"] == "miss"
    finally:
        tokenizer.chat_template = original_template
    hit = load_or_tokenize(path, cfg, tokenizer)
    assert hit.stats["cache"] == "hit"
    np.testing.assert_array_equal(hit.input_ids, changed.input_ids)


def test_cache_is_keyed_by_the_format_code(tmp_path, tokenizer, monkeypatch):
    import importlib
    import sys

    import data_formats

    module = tmp_path / "mine_format.py"
    source = """
from data_formats import DataFormat, register

@register
class Mine(DataFormat):
    name = "mine"

    def to_messages(self, record):
        return [{"role": "user", "content": record["q"]}, {"role": "assistant", "content": record["a"]}]
"""
    module.write_text(source)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(data_formats, "_REGISTRY", dict(data_formats._REGISTRY))
    importlib.import_module("mine_format")
    monkeypatch.setitem(sys.modules, "mine_format", sys.modules["mine_format"])
    path = write_jsonl(tmp_path / "d.jsonl", [{"q": "Hi", "a": "yo"}])
    cfg = DataConfig(format="mine", path=str(path), max_seq_len=64, cache_dir=str(tmp_path / "cache"))
    first = load_or_tokenize(path, cfg, tokenizer)
    assert first.stats["cache"] == "miss" and load_or_tokenize(path, cfg, tokenizer).stats["cache"] == "hit"
    module.write_text(source.replace('record["a"]}', 'record["a"] + "!"}'))  # the user fixes their format
    importlib.reload(sys.modules["mine_format"])
    fixed = load_or_tokenize(path, cfg, tokenizer)
    assert fixed.stats["cache"] == "miss" and len(fixed.input_ids) > len(first.input_ids)


def test_json_array_and_parquet_files(tmp_path, tokenizer):
    rows = [{"instruction": f"Say {i}", "input": "", "output": str(i)} for i in range(5)]
    (tmp_path / "d.json").write_text(json.dumps(rows))
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "d.parquet")
    for name in ("d.json", "d.parquet"):
        cfg = DataConfig(format="alpaca", path=str(tmp_path / name), max_seq_len=64, cache_dir=str(tmp_path / "cache"))
        assert len(load_or_tokenize(cfg.path, cfg, tokenizer)) == 5


def test_byte_order_marks_and_one_document_json(tmp_path):
    from ftctl.data.records import read_records

    rows = [{"instruction": f"Say {i}", "output": str(i)} for i in range(3)]
    (tmp_path / "bom.json").write_text("\ufeff" + json.dumps(rows), encoding="utf-8")
    (tmp_path / "bom.jsonl").write_text("\ufeff" + "".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    for name in ("bom.json", "bom.jsonl"):
        assert [r.data for r in read_records(tmp_path / name)] == rows
    (tmp_path / "doc.json").write_text(json.dumps({"version": 1, "data": rows}, indent=2))
    with pytest.raises(FtctlError, match=r"doc.json: one JSON object; ftctl reads a JSON array .* under 'data'"):
        read_records(tmp_path / "doc.json")
    (tmp_path / "one.json").write_text(json.dumps(rows[0]))  # one record on one line is JSON lines
    assert [r.data for r in read_records(tmp_path / "one.json")] == rows[:1]


def test_malformed_json_line_names_file_and_line(tmp_path, tokenizer):
    path = tmp_path / "bad.jsonl"
    path.write_text('{"instruction": "a", "output": "b"}\n{"instruction": "a", "output": }\n')
    cfg = DataConfig(format="alpaca", path=str(path), cache_dir=str(tmp_path / "cache"))
    with pytest.raises(FtctlError, match=r"bad.jsonl:2: malformed JSON line"):
        load_or_tokenize(path, cfg, tokenizer)


def test_wrong_format_suggests_the_one_it_looks_like(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "chat.jsonl", [MULTI_TURN])
    cfg = DataConfig(format="alpaca", path=str(path), cache_dir=str(tmp_path / "cache"))
    with pytest.raises(FtctlError, match=r"chat.jsonl:1: not a valid 'alpaca' record: missing required field 'instruction'.*data.format=sharegpt"):
        load_or_tokenize(path, cfg, tokenizer)


def test_eval_fraction_splits_without_overlap(tokenizer, tmp_path):
    rows = [{"instruction": f"Say {i}", "output": f"{i} {i}"} for i in range(64)]
    cfg = DataConfig(format="alpaca", path=str(write_jsonl(tmp_path / "d.jsonl", rows)), eval_fraction=0.25,
                     cache_dir=str(tmp_path / "cache"))
    train, evaluation = build_datasets(cfg, tokenizer, seed=0)
    assert (len(train), len(evaluation)) == (48, 16)
    train_rows = {tuple(train[i][0]) for i in range(len(train))}
    assert not any(tuple(evaluation[i][0]) in train_rows for i in range(len(evaluation)))


def test_step_sampler_global_batch_is_independent_of_world_size():
    sampler = StepSampler(num_examples=10, global_batch_size=4, seed=3)
    for step in range(6):
        batch = sampler.global_batch(step)
        assert len(batch) == 4
        assert sampler.rank_share(step, 0, 2) + sampler.rank_share(step, 1, 2) == batch
    first_epoch = sum((sampler.global_batch(s) for s in range(2)), []) + sampler.global_batch(2)[:2]
    assert sorted(first_epoch) == list(range(10))  # an epoch visits every example once


def test_preview_marks_trained_spans(tokenizer):
    messages = get_format("sharegpt").to_messages(MULTI_TURN)
    example = tokenize_conversation(messages, tokenizer, max_seq_len=512)
    text = mark_spans(tokenizer, example.input_ids, example.labels)
    assert f"{TRAINED_OPEN}6<|im_end|>{TRAINED_CLOSE}\n" in text
    assert f"{TRAINED_OPEN}tac<|im_end|>{TRAINED_CLOSE}" in text
    assert text.count(TRAINED_OPEN) == 2
    everything = tokenize_conversation(messages, tokenizer, max_seq_len=512, train_on_prompt=True)
    # Even with train_on_prompt the first token is no target (nothing precedes it), and the preview says so.
    first = tokenizer.decode(everything.input_ids[:1])
    assert mark_spans(tokenizer, everything.input_ids, everything.labels).startswith(f"{first}{TRAINED_OPEN}")
