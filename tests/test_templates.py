"""Named chat templates: exactly the tokens of each answer's {% generation %} block train (checked against
transformers' return_assistant_tokens_mask), and a template's special tokens that the tokenizer splits are
warned about or, with data.add_special_tokens=true, added, grown into the model and trained."""

from __future__ import annotations

import json
import logging

import pytest
import torch
from safetensors import safe_open

from ftctl.cli import main
from ftctl.data.chat_templates import CHAT_TEMPLATES, TEMPLATE_SPECIAL_TOKENS
from ftctl.data.render import FALLBACK_CHAT_TEMPLATE, IGNORE_INDEX, tokenize_conversation

CONVERSATION = [
    {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"},
    {"role": "assistant", "content": "Yo, hello"}, {"role": "user", "content": "Again?"},
    {"role": "assistant", "content": "Sure thing"},
]
QUIET = ("precision=fp32", "train.progress_bar=false", "train.tensorboard=false", "train.plot=false", "train.num_threads=1")


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


@pytest.mark.parametrize("name", [*CHAT_TEMPLATES, "fallback"])
def test_trained_tokens_are_what_transformers_marks_as_the_assistants(tokenizer, name):
    tokenizer.chat_template = FALLBACK_CHAT_TEMPLATE if name == "fallback" else CHAT_TEMPLATES[name]
    reference = tokenizer.apply_chat_template(CONVERSATION, tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
    ids, mask = list(reference["input_ids"]), [bool(m) for m in reference["assistant_masks"]]
    example = tokenize_conversation(CONVERSATION, tokenizer, max_seq_len=1024)
    end = max(k + 1 for k, m in enumerate(mask) if m)  # what the template writes after the last answer is left out
    assert example.input_ids[:end] == ids[:end]
    assert [label != IGNORE_INDEX for label in example.labels[:end]] == mask[:end]
    assert tokenizer.decode(ids[end:]).strip() == ""  # only the whitespace after the last end of turn
    eos = tokenizer.eos_token_id
    # An end of turn that is not EOS gets EOS right after it, trained, so the model learns to stop.
    assert example.input_ids[end:] == ([] if ids[end - 1] == eos else [eos]) == [t for t in example.labels[end:]]
    assert sum(mask) >= 4  # both answers, each with its end-of-turn marker


def test_a_template_without_generation_blocks_trains_up_to_the_end_of_turn(tokenizer, tiny_model_dir):
    from transformers import AutoTokenizer

    own = AutoTokenizer.from_pretrained(tiny_model_dir)  # ChatML written without {% generation %}
    assert "generation %}" not in own.chat_template
    example = tokenize_conversation(CONVERSATION, own, max_seq_len=1024)
    trained = own.decode([t for t, label in zip(example.input_ids, example.labels) if label != IGNORE_INDEX])
    assert trained == "Yo, hello<|im_end|>Sure thing<|im_end|>"  # not the "\n" ChatML writes after <|im_end|>


def test_a_split_special_token_is_one_warning_line_or_added(tokenizer, tiny_model_dir, caplog):
    from transformers import AutoTokenizer

    from ftctl.data.template_tokens import add_template_tokens, split_special_tokens

    assert split_special_tokens(tokenizer, "chatml") == {}  # this tokenizer has ChatML's markers
    split = split_special_tokens(tokenizer, "llama3")
    assert set(split) == set(TEMPLATE_SPECIAL_TOKENS["llama3"]) and all(n > 1 for n in split.values())
    with caplog.at_level(logging.WARNING, logger="ftctl"):
        assert add_template_tokens(tokenizer, "llama3", add=False) == []
    [record] = caplog.records
    assert "\n" not in record.getMessage() and "<|eot_id|> (" in record.getMessage()
    assert "data.add_special_tokens=true" in record.getMessage()
    assert len(tokenizer) == 512  # nothing added
    tokenizer.chat_template = CHAT_TEMPLATES["llama3"]
    spelled = len(tokenize_conversation(CONVERSATION, tokenizer, max_seq_len=1024).input_ids)
    grown = AutoTokenizer.from_pretrained(tiny_model_dir)
    grown.chat_template = CHAT_TEMPLATES["llama3"]
    assert add_template_tokens(grown, "llama3", add=True) == [512, 513, 514]
    assert split_special_tokens(grown, "llama3") == {}
    example = tokenize_conversation(CONVERSATION, grown, max_seq_len=1024)
    assert len(example.input_ids) < spelled / 2  # every marker one token instead of 10 to 16
    assert grown.decode([t for t, label in zip(example.input_ids, example.labels) if label != IGNORE_INDEX]) == (
        "Yo, hello<|eot_id|>Sure thing<|eot_id|><|im_end|>")


def test_add_special_tokens_needs_a_named_template(capsys):
    assert main(["train", "recipe=tiny_lora", "data.add_special_tokens=true", "--cfg"]) == 2
    err = capsys.readouterr().err
    assert "data.add_special_tokens=true adds a named template's special tokens; set data.chat_template to one of chatml, llama3" in err
    assert err.count("\n") == 1


def _adapter_tensor(path, suffix):
    with safe_open(str(path / "adapter_model.safetensors"), framework="pt") as f:
        [key] = [k for k in f.keys() if k.endswith(suffix)]
        return f.get_tensor(key)


@pytest.mark.slow
def test_added_tokens_train_and_the_result_merges_exports_and_chats(tmp_path, capsys, make_cfg, run_training):
    """A tied-embedding model (as SmolLM2) with llama3's markers: they become single tokens, their rows train,
    and merge, GGUF export and chat take the grown result."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ftctl.models.tiny import build_tiny_llama

    tied = build_tiny_llama(tmp_path / "tied", tie_word_embeddings=True)
    common = ("data=sharegpt_sample", "data.chat_template=llama3", "train.max_steps=3", "train.save_every=1",
              "train.keep_last=0", "train.lr=1e-2", "train.warmup_steps=0", "train.global_batch_size=4")
    result, _ = run_training(make_cfg(*common, "data.add_special_tokens=true", model_dir=tied))
    final = result.final_dir
    tokenizer = AutoTokenizer.from_pretrained(final)
    assert len(tokenizer) == 515 and all(len(tokenizer.encode(t, add_special_tokens=False)) == 1 for t in TEMPLATE_SPECIAL_TOKENS["llama3"])
    assert json.loads((final / "ftctl_adapter.json").read_text())["vocab_rows"] == 515
    # The new rows train: the embedding (tied to the head) changes between checkpoints, in the new rows too.
    first = _adapter_tensor(result.run_dir / "checkpoints" / "step-1", "embed_tokens.weight")
    last = _adapter_tensor(final, "embed_tokens.weight")
    assert first.shape == (515, 64) and (last[512:] - first[512:]).abs().max() > 1e-4

    assert main(["merge", f"adapter={final}", f"output={tmp_path / 'merged'}"]) == 0
    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged", dtype=torch.float32).eval()
    ids = torch.tensor([[1, 5, 512, 40, 514, 7]])
    with torch.no_grad():
        from peft import PeftModel

        base = AutoModelForCausalLM.from_pretrained(tied, dtype=torch.float32)
        base.resize_token_embeddings(515, mean_resizing=False)
        expected = PeftModel.from_pretrained(base, str(final)).eval()(input_ids=ids).logits
        assert (merged(input_ids=ids).logits - expected).abs().max() <= 1e-4
    assert main(["export", f"model={final}", "format=gguf", f"output={tmp_path / 'm.gguf'}"]) == 0
    import gguf

    tokens = gguf.GGUFReader(str(tmp_path / "m.gguf")).fields["tokenizer.ggml.tokens"]
    assert len(tokens.data) == 515 and bytes(tokens.parts[tokens.data[514]]).decode() == "<|eot_id|>"
    capsys.readouterr()
    assert main(["chat", f"model={result.run_dir}", "prompt=Hi", "max_new_tokens=3"]) == 0
