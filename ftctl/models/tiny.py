"""Tiny random models with their own byte-level BPE tokenizer, built locally (tests and the quick demo):
a Llama (:func:`build_tiny_llama`) or any family of :data:`TINY_FAMILIES` (:func:`build_tiny_model`).

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
    chat_template: bool = True,
    pad_token: bool = True,
    tie_word_embeddings: bool = False,
    **shape,
) -> Path:
    """Write a random Llama (safetensors) and tokenizer into ``out_dir``; return the dir.

    ``chat_template=False`` / ``pad_token=False`` give a tokenizer without a template that pads with
    EOS (the fallback-template path); ``shape`` takes :func:`build_tiny_model`'s size keywords.
    """
    return build_tiny_model("llama", out_dir, chat_template=chat_template, pad_token=pad_token,
                            tie_word_embeddings=tie_word_embeddings, **shape)


#: Tiny random configs of the decoder families ftctl is tested on: transformers config class and the
#: keys that differ from the shared shape (2 layers, hidden 64, 4 heads of 16, 2 KV heads, FFN 128).
#: Sizes the configs default to for real models (Gemma's head_dim 256, MoE expert counts, sliding
#: windows of thousands) are shrunk so every family builds and runs in milliseconds.
TINY_FAMILIES = {
    "llama": ("LlamaConfig", {}),
    "qwen2": ("Qwen2Config", {}),
    "qwen3": ("Qwen3Config", {"head_dim": 16}),
    "mistral": ("MistralConfig", {"head_dim": 16, "sliding_window": None}),
    "gemma2": ("Gemma2Config", {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 32}),
    "gemma3": ("Gemma3TextConfig", {"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 32}),
    "phi3": ("Phi3Config", {}),
    "olmo2": ("Olmo2Config", {}),
    # Non-trivial multipliers, so a path that ignores them (the fused head loss) would show.
    "granite": ("GraniteConfig", {"logits_scaling": 2.0, "embedding_multiplier": 1.5, "residual_multiplier": 0.5,
                                  "attention_multiplier": 0.25}),
    "smollm3": ("SmolLM3Config", {}),
    "gpt2": ("GPT2Config", {}),
    # YaRN's factor must equal max_position_embeddings / original_max_position_embeddings (1024 / 32).
    "gpt_oss": ("GptOssConfig", {"head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": 32,
                                 "rope_parameters": {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                                                     "truncate": False, "original_max_position_embeddings": 32,
                                                     "rope_theta": 150000.0}}),
    "mixtral": ("MixtralConfig", {"head_dim": 16, "num_local_experts": 4, "num_experts_per_tok": 2, "sliding_window": None}),
    "qwen3_moe": ("Qwen3MoeConfig", {"head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
                                     "moe_intermediate_size": 64, "decoder_sparse_step": 1}),
}


def build_tiny_model(
    family: str,
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
    # Llama's 0.02 leaves a 64-wide random model's layers nearly silent next to the embeddings,
    # so adapters could barely move the loss; 0.1 gives tests a model that learns like a real one.
    initializer_range: float = 0.1,
    chat_template: bool = True,
    pad_token: bool = True,
    tokenizer_from: str | Path | None = None,
    **overrides,
) -> Path:
    """Write a random model of ``family`` (a key of :data:`TINY_FAMILIES`) and the ChatML tokenizer into ``out_dir``.

    ``tokenizer_from`` (a model dir) gives the model that dir's tokenizer instead, e.g. a real family's;
    the vocabulary then sets the embedding size. ``overrides`` set further config keys (e.g.
    ``tie_word_embeddings``). Deterministic: the same arguments give the same weights.
    """
    import torch
    import transformers

    if family not in TINY_FAMILIES:
        raise ValueError(f"unknown family {family!r}; known: {', '.join(TINY_FAMILIES)}")
    config_class_name, family_keys = TINY_FAMILIES[family]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    if tokenizer_from is not None:
        tokenizer = transformers.AutoTokenizer.from_pretrained(tokenizer_from)
        tokenizer.save_pretrained(out)
    else:
        tokenizer = build_tokenizer(out, vocab_size=vocab_size, chat_template=chat_template, pad_token=pad_token)
    if family == "gpt2":
        shape = {"n_embd": hidden_size, "n_layer": num_layers, "n_head": num_heads, "n_inner": intermediate_size,
                 "n_positions": max_position_embeddings}
    else:
        shape = {"hidden_size": hidden_size, "num_hidden_layers": num_layers, "num_attention_heads": num_heads,
                 "num_key_value_heads": num_kv_heads, "intermediate_size": intermediate_size,
                 "max_position_embeddings": max_position_embeddings}
    config = getattr(transformers, config_class_name)(
        vocab_size=len(tokenizer),
        initializer_range=initializer_range,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        **{**shape, **family_keys, **overrides},
    )
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(config)
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.generation_config.eos_token_id = tokenizer.eos_token_id
    model.generation_config.bos_token_id = tokenizer.bos_token_id
    model.save_pretrained(out, safe_serialization=True)
    (out / "ftctl_tiny.json").write_text(json.dumps({"seed": seed, "num_layers": num_layers, "family": family}))
    return out
