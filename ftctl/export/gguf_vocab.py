"""A transformers tokenizer described as GGUF tokenizer metadata, the way llama.cpp's converter writes it.

Byte-level BPE (GPT-2 style, as SmolLM, Llama 3 and the tiny test model use) is written as
``tokenizer.ggml.model = "gpt2"``: the vocabulary in its byte-alphabet spelling, the merges, token
types (added special tokens are CONTROL, other added tokens USER_DEFINED) and the name of the
pre-tokenizer (``tokenizer.ggml.pre``) that splits text before the merges apply. llama.cpp picks
its split regex by that name, so a pre-tokenizer ftctl cannot name exactly is refused rather than
written under a guess that would tokenize differently.

SentencePiece-style BPE (Llama 2, Mistral, TinyLlama: byte fallback, ``▁`` for spaces) is written as
``tokenizer.ggml.model = "llama"`` with scores that rank tokens in merge order and ``<0xNN>`` byte
tokens typed BYTE.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Dict, List, Optional

from ftctl.errors import FtctlError

NORMAL, UNKNOWN, CONTROL, USER_DEFINED, UNUSED, BYTE = 1, 2, 3, 4, 5, 6  # gguf.TokenType values

SPIECE_SPACE = "\u2581"

#: The GPT-2 split regex, which a bare ByteLevel pre-tokenizer (use_regex=true) applies.
GPT2_PRE = "gpt2"
#: ByteLevel with every digit split off first (SmolLM's tokenizer.json); llama.cpp's "smollm" does the same.
DIGITS_THEN_GPT2_PRE = "smollm"
#: llama.cpp names for the split regexes transformers' GGUF loader knows, preferred name first.
_SPLIT_REGEX_NAMES = ("llama-bpe", "qwen2", "gpt-4o", "tekken")


@dataclass
class GGUFVocab:
    model: str
    tokens: List[str]
    token_types: List[int]
    merges: List[str]
    pre: Optional[str] = None
    scores: Optional[List[float]] = None
    special_ids: Dict[str, int] = field(default_factory=dict)  # bos, eos, unk, pad
    add_bos: bool = False
    add_eos: bool = False
    add_space_prefix: Optional[bool] = None
    chat_template: Optional[str] = None


def _split_regex_names() -> Dict[str, str]:
    """Split regex -> llama.cpp pre-tokenizer name, from the table transformers' GGUF loader reads back."""
    try:
        from transformers.integrations.gguf.gguf_tokenizer_mapping import GGUF_PRE_TOKENIZER_SPLITS
    except ImportError:  # an older transformers reads only GPT-2 style files back
        return {}
    return {GGUF_PRE_TOKENIZER_SPLITS[name]: name for name in reversed(_SPLIT_REGEX_NAMES) if name in GGUF_PRE_TOKENIZER_SPLITS}


def byte_level_pre_tokenizer(pre: Optional[dict]) -> str:
    """The llama.cpp name (tokenizer.ggml.pre) of a byte-level tokenizer.json pre-tokenizer, or a clear error."""
    def is_byte_level(node, regex: bool) -> bool:
        return node.get("type") == "ByteLevel" and bool(node.get("use_regex", True)) == regex and not node.get("add_prefix_space", False)

    if pre and is_byte_level(pre, regex=True):
        return GPT2_PRE
    steps = pre.get("pretokenizers", []) if pre and pre.get("type") == "Sequence" else []
    if len(steps) == 2 and steps[0].get("type") == "Digits" and steps[0].get("individual_digits") and is_byte_level(steps[1], regex=True):
        return DIGITS_THEN_GPT2_PRE
    if (
        len(steps) == 2 and steps[0].get("type") == "Split" and is_byte_level(steps[1], regex=False)
        and steps[0].get("behavior") == "Isolated" and not steps[0].get("invert")
    ):
        name = _split_regex_names().get((steps[0].get("pattern") or {}).get("Regex"))
        if name:
            return name
    raise FtctlError(
        "GGUF export: the tokenizer's pre-tokenizer is not one ftctl can name for llama.cpp "
        f"({json.dumps(pre)[:200]}); supported: GPT-2 byte-level, SmolLM digits + byte-level, and the "
        f"{', '.join(_SPLIT_REGEX_NAMES)} split patterns. Export format=hf, or convert with llama.cpp's convert_hf_to_gguf.py"
    )


def _sentencepiece_space_prefix(spec: dict) -> Optional[bool]:
    """Whether a SentencePiece-style tokenizer.json prepends ▁ to the text (None: it is not SentencePiece-style)."""
    pre, normalizer = spec.get("pre_tokenizer") or {}, spec.get("normalizer") or {}
    if pre.get("type") == "Metaspace" and pre.get("replacement") == SPIECE_SPACE:
        return pre.get("prepend_scheme", "always") != "never" and pre.get("add_prefix_space", True)
    steps = normalizer.get("normalizers", []) if normalizer.get("type") == "Sequence" else [normalizer]
    replaces_spaces = any(s.get("type") == "Replace" and s.get("content") == SPIECE_SPACE for s in steps)
    if replaces_spaces and not pre:
        return any(s.get("type") == "Prepend" and s.get("prepend") == SPIECE_SPACE for s in steps)
    return None


def _added_specials(tokenizer) -> tuple:
    """(adds BOS, adds EOS): what encoding with special tokens puts around the text."""
    plain = tokenizer("a", add_special_tokens=False)["input_ids"]
    full = tokenizer("a", add_special_tokens=True)["input_ids"]
    extra = len(full) > len(plain)
    return (
        extra and tokenizer.bos_token_id is not None and full[0] == tokenizer.bos_token_id,
        extra and tokenizer.eos_token_id is not None and full[-1] == tokenizer.eos_token_id,
    )


def vocab_for_gguf(tokenizer, vocab_size: int) -> GGUFVocab:
    """The GGUF description of ``tokenizer`` for a model that embeds ``vocab_size`` tokens."""
    backend = getattr(tokenizer, "backend_tokenizer", None)
    if backend is None:
        raise FtctlError("GGUF export needs a fast (tokenizers-backed) tokenizer with a tokenizer.json; this one has none")
    spec = json.loads(backend.to_str())
    bpe = spec.get("model") or {}
    if bpe.get("type") != "BPE":
        raise FtctlError(f"GGUF export: the tokenizer is a {bpe.get('type')} model; ftctl writes BPE tokenizers (byte-level or SentencePiece-style)")

    id_to_token = {index: token for token, index in tokenizer.get_vocab().items()}
    if max(id_to_token) >= vocab_size:
        raise FtctlError(f"the tokenizer has ids up to {max(id_to_token)} but the model embeds only {vocab_size} tokens")
    added = {index: token for index, token in tokenizer.added_tokens_decoder.items()}
    merges = [m if isinstance(m, str) else " ".join(m) for m in bpe.get("merges", [])]

    space_prefix = _sentencepiece_space_prefix(spec) if bpe.get("byte_fallback") else None
    if space_prefix is None:
        model, pre, scores = "gpt2", byte_level_pre_tokenizer(spec.get("pre_tokenizer")), None
    else:
        model, pre = "llama", None
        # llama.cpp's SentencePiece tokenizer merges the best-scoring pair first: rank tokens by the merge that makes them.
        made_by = {m.replace(" ", ""): rank for rank, m in reversed(list(enumerate(merges)))}
        scores = [-float(made_by.get(id_to_token.get(i, ""), len(merges) + i)) for i in range(vocab_size)]

    tokens, types = [], []
    for index in range(vocab_size):
        token = id_to_token.get(index)
        if token is None:
            tokens.append(f"[PAD{index}]")
            types.append(UNUSED)
            continue
        if model == "llama" and len(token) == 6 and token.startswith("<0x") and token.endswith(">"):
            kind = BYTE  # byte-fallback pieces, whether tokenizer.json lists them as added tokens or not
        elif token == bpe.get("unk_token"):
            kind = UNKNOWN
        elif index in added:
            kind = CONTROL if added[index].special else USER_DEFINED
        else:
            kind = NORMAL
        tokens.append(token)
        types.append(kind)

    special_ids = {}
    for name in ("bos", "eos", "unk", "pad"):
        token_id = getattr(tokenizer, f"{name}_token_id", None)
        if token_id is not None:
            special_ids[name] = token_id
    add_bos, add_eos = _added_specials(tokenizer)
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default") or next(iter(template.values()), None)
    return GGUFVocab(
        model=model, tokens=tokens, token_types=types, merges=merges, pre=pre, scores=scores,
        special_ids=special_ids,
        add_bos=add_bos, add_eos=add_eos,
        add_space_prefix=space_prefix, chat_template=template or None,
    )


def add_vocab(writer, vocab: GGUFVocab) -> None:
    writer.add_tokenizer_model(vocab.model)
    if vocab.pre:
        writer.add_tokenizer_pre(vocab.pre)
    writer.add_token_list(vocab.tokens)
    if vocab.scores is not None:
        writer.add_token_scores(vocab.scores)
    writer.add_token_types(vocab.token_types)
    if vocab.merges:
        writer.add_token_merges(vocab.merges)
    adders = {"bos": writer.add_bos_token_id, "eos": writer.add_eos_token_id, "unk": writer.add_unk_token_id, "pad": writer.add_pad_token_id}
    for name, token_id in vocab.special_ids.items():
        adders[name](token_id)
    writer.add_add_bos_token(vocab.add_bos)
    writer.add_add_eos_token(vocab.add_eos)
    if vocab.add_space_prefix is not None:
        writer.add_add_space_prefix(vocab.add_space_prefix)
    if vocab.chat_template:
        writer.add_chat_template(vocab.chat_template)
