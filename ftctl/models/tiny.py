"""A tiny random Llama with its own byte-level BPE tokenizer, built locally (tests and the quick demo).

Deterministic: the same arguments give the same weights and the same vocabulary.
"""

from __future__ import annotations

import json
from pathlib import Path

from ftctl.paths import samples_dir

CHATML_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def _training_text():
    for path in sorted(samples_dir().glob("*.jsonl")):
        for line in path.read_text().splitlines():
            yield line
    yield "".join(chr(c) for c in range(32, 127))


def build_tokenizer(out_dir: Path, *, vocab_size: int = 512, chat_template: bool = True, pad_token: bool = True):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"] + (["<pad>"] if pad_token else [])
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_training_text(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token="<|im_end|>" if chat_template else "<|endoftext|>",
        pad_token="<pad>" if pad_token else ("<|im_end|>" if chat_template else "<|endoftext|>"),
        unk_token=None,
    )
    if chat_template:
        fast.chat_template = CHATML_TEMPLATE
    fast.save_pretrained(out_dir)
    return fast


def build_tiny_llama(
    out_dir: str | Path,
    *,
    num_layers: int = 2,
    hidden_size: int = 64,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    vocab_size: int = 512,
    max_position_embeddings: int = 1024,
    seed: int = 0,
    chat_template: bool = True,
    pad_token: bool = True,
    tie_word_embeddings: bool = False,
    initializer_range: float = 0.1,
) -> Path:
    """Write a random Llama (safetensors) and tokenizer into ``out_dir``; return the dir."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out, vocab_size=vocab_size, chat_template=chat_template, pad_token=pad_token)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=num_layers,
        num_attention_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=tie_word_embeddings,
        # Llama's 0.02 leaves a 64-wide random model's layers nearly silent next to the embeddings,
        # so adapters could barely move the loss; 0.1 gives tests a model that learns like a real one.
        initializer_range=initializer_range,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out, safe_serialization=True)
    (out / "ftctl_tiny.json").write_text(json.dumps({"seed": seed, "num_layers": num_layers}))
    return out
