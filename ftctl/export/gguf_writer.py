"""Write a transformers model and its tokenizer as one GGUF file (llama.cpp, Ollama, LM Studio).

What goes in follows llama.cpp's convert_hf_to_gguf.py for the model's family
(ftctl.export.gguf_families: Llama, Mistral, Mixtral, Qwen2, Qwen3, Qwen3-MoE, Gemma 2, Gemma 3,
Phi-3): the ``{arch}.*`` hyperparameters, tokenizer metadata (ftctl.export.gguf_vocab), and the
tensors under llama.cpp names (ftctl.export.tensor_names) in the family's conventions. Norm weights,
expert routers and other 1-D tensors stay F32 whatever the requested type, as llama.cpp keeps them;
a matrix whose rows do not split into q8_0 blocks of 32 falls back to F16. The k-quants (q4_k_m,
q5_k_m, q6_k) are llama.cpp's own: ftctl writes f16 and llama.cpp's quantizer (ftctl.export.llamacpp)
makes the file from it, choosing per tensor as ``llama-quantize`` does.

Tensors are converted one at a time while the file is written, so memory holds the model plus one
converted tensor. The file appears under its name only when complete. When llama.cpp's binding is
installed, llama.cpp loads the finished file's vocabulary first: a file it cannot load is not written
(the error gives llama.cpp's reason), and check texts it tokenizes otherwise than transformers are a
warning.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np

from ftctl.errors import FtctlError
from ftctl.export.gguf_families import (
    GGUFFamily, add_hyperparameters, computed_tensors, family_of, gguf_refusal,
)
from ftctl.export import llamacpp
from ftctl.export.gguf_vocab import GGUFVocab, add_vocab, pre_tokenizer_table, vocab_for_gguf
from ftctl.export.tensor_names import gguf_tensor_name, interleave_rotary_rows, split_tensor_names
from ftctl.paths import check_output_path, make_parent
from ftctl.progress import progress_bar

log = logging.getLogger("ftctl")

#: gguf.quant= choices ftctl writes itself: (llama.cpp file type, tensor type of the matrices).
QUANT_TYPES = {"f32": ("ALL_F32", "F32"), "f16": ("MOSTLY_F16", "F16"), "bf16": ("MOSTLY_BF16", "BF16"), "q8_0": ("MOSTLY_Q8_0", "Q8_0")}
#: Every gguf.quant= choice: those and the k-quants llama.cpp's quantizer writes from ftctl's f16 file.
QUANT_CHOICES = (*QUANT_TYPES, *llamacpp.K_QUANTS)
K_QUANT_SOURCE = "f16"
DEFAULT_QUANT = "f16"
#: llama.cpp sets Phi-3's token attributes for any model whose name holds one of these, looking up these tokens.
PHI3_NAME_MARKERS = ("phi-3", "phi3")
PHI3_TOKENS = ("</s>", "<unk>", "<s>", "<|endoftext|>")
#: Texts llama.cpp must tokenize as transformers does (beside llama.cpp's own check text): digits,
#: whitespace runs, punctuation, accents and scripts, emoji, chat markup with special tokens.
TOKENIZER_CHECK_TEXTS = (
    "Hello, world! Could you send 12 orange kettles to Perth?",
    "digits 0 12 345 6789 3.14159 -42 1e-5 2024-11-30",
    "whitespace   runs\t\ttabs\n\nnewlines \n  \n   ",
    "punctuation: ([{<>}]) !?;:'\"`~@#$%^&*-_=+|\\/ ... --- ===",
    "naïve café — Ωmega, 日本語, Русский, emoji 🚀🦙",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "I've been 'told he's there, 'RE you sure? We'Ve a'lL",
)
ROUTER_SUFFIX = "ffn_gate_inp.weight"


def quant_refusal(quant: str) -> Optional[str]:
    """Why ``quant`` cannot be written here (not a choice, or a k-quant without llama.cpp's binding), or None."""
    if quant not in QUANT_CHOICES:
        return f"gguf.quant={quant} is not one of {', '.join(QUANT_CHOICES)}"
    if quant in llamacpp.K_QUANTS and not llamacpp.available():
        return f"gguf.quant={quant} is written by llama.cpp's own quantizer, which needs its Python binding: {llamacpp.INSTALL_HINT}"
    return None


def name_refusal(name: str, vocab: GGUFVocab) -> Optional[str]:
    """llama.cpp gives a model whose general.name says Phi-3 Phi-3's token rules, which fail on a vocabulary without its tokens."""
    known = set(vocab.tokens)
    missing = [token for token in PHI3_TOKENS if token not in known]
    if any(marker in name.lower() for marker in PHI3_NAME_MARKERS) and missing:
        return (
            f"name={name} (the output file's name unless name= is given): llama.cpp takes a model named like Phi-3 for Phi-3 "
            f"and cannot load it without the tokens {', '.join(missing)}, which this tokenizer lacks; pass another name="
        )
    return None


def add_file_type(writer, quant: str) -> None:
    import gguf

    writer.add_file_type(getattr(gguf.LlamaFileType, QUANT_TYPES[quant][0]))
    if quant not in ("f32", "f16"):
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


@dataclass
class _PlannedTensor:
    gguf_name: str
    source: str  # the transformers state_dict key, or "" for a tensor computed here
    heads: Optional[int]  # rows are permuted over this many heads
    offset: float  # added to the values (Gemma's norm weights)
    half: Optional[int]  # 0 or 1: this half of dim 1 only (fused experts' gate, up)
    shape: tuple
    qtype: object  # gguf.GGMLQuantizationType


def _tensor_type(shape: tuple, target, name: str):
    import gguf

    F32, F16 = gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16
    if len(shape) < 2 or name.endswith(ROUTER_SUFFIX):  # llama.cpp's converter keeps expert routers in F32 too
        return F32
    block = gguf.GGML_QUANT_SIZES[target][0]
    if shape[-1] % block:
        log.info("%s: rows of %d do not split into %s blocks of %d; written as F16", name, shape[-1], target.name, block)
        return F16
    return target


def _byte_count(shape: tuple, qtype) -> int:
    import gguf

    return int(np.prod(gguf.quant_shape_to_byte_shape(shape, qtype)))


def plan_tensors(state: Dict[str, "object"], config, quant: str, family: Optional[GGUFFamily] = None) -> List[_PlannedTensor]:
    """Every GGUF tensor with its source, permutation and type; unknown source tensors are an error."""
    import gguf

    family = family or family_of(config)
    target = getattr(gguf.GGMLQuantizationType, QUANT_TYPES[quant][1])
    tied = bool(getattr(config, "tie_word_embeddings", False))
    plan, unknown = [], []
    for key, tensor in state.items():
        if tied and key == "lm_head.weight":
            continue  # llama.cpp reuses token_embd when output.weight is absent
        halves = split_tensor_names(key, family.arch, config.num_hidden_layers)
        if halves:
            shape = (tensor.shape[0], tensor.shape[1] // 2, *tensor.shape[2:])
            for half, name in enumerate(halves):
                plan.append(_PlannedTensor(name, key, None, 0.0, half, shape, _tensor_type(shape, target, name)))
            continue
        name, heads_key = gguf_tensor_name(key, family.arch, config.num_hidden_layers, family.interleave_rotary)
        if name is None:
            unknown.append(key)
            continue
        heads = (getattr(config, heads_key, None) or config.num_attention_heads) if heads_key else None
        offset = family.norm_offset if key.endswith("norm.weight") else 0.0
        shape = tuple(tensor.shape)
        plan.append(_PlannedTensor(name, key, heads, offset, None, shape, _tensor_type(shape, target, name)))
    if unknown:
        raise FtctlError(
            f"GGUF export: {len(unknown)} tensors have no place in a llama.cpp {family.arch} file, e.g. {', '.join(unknown[:3])}. "
            "Export format=hf instead"
        )
    for name, values in computed_tensors(config).items():
        plan.append(_PlannedTensor(name, "", None, 0.0, None, values.shape, gguf.GGMLQuantizationType.F32))
    return plan


def _tensor_data(entry: _PlannedTensor, state, config) -> np.ndarray:
    import gguf
    import torch

    if not entry.source:
        return computed_tensors(config)[entry.gguf_name]
    array = state[entry.source].detach().to(device="cpu", dtype=torch.float32).numpy()
    if entry.half is not None:
        width = array.shape[1] // 2
        array = array[:, entry.half * width:(entry.half + 1) * width]
    if entry.heads:
        array = interleave_rotary_rows(array, entry.heads)
    if entry.offset:
        array = array + np.float32(entry.offset)
    return gguf.quants.quantize(np.ascontiguousarray(array), entry.qtype)


def write_gguf(model, tokenizer, output, quant: str = DEFAULT_QUANT, *, name: Optional[str] = None, overwrite: bool = False) -> Path:
    """Write ``model`` (a transformers model of a family in gguf_families) with ``tokenizer`` to the GGUF file ``output``; return its path."""
    refusal = quant_refusal(quant)
    if refusal:
        raise FtctlError(refusal)
    output = Path(output).expanduser().absolute()
    check_gguf_output(output, overwrite)
    config = model.config
    refusal = gguf_refusal(config)
    if refusal:
        raise FtctlError(refusal)
    vocab = vocab_for_gguf(tokenizer, config.vocab_size)
    name = name or output.stem
    refusal = name_refusal(name, vocab)
    if refusal:
        raise FtctlError(refusal)
    state = model.state_dict()

    make_parent(output, "output")
    staging = output.with_name(f".{output.name}.partial-{os.getpid()}")
    try:
        if quant in llamacpp.K_QUANTS:
            source = output.with_name(f".{output.name}.{K_QUANT_SOURCE}-{os.getpid()}")
            try:
                _write_file(source, state, config, vocab, K_QUANT_SOURCE, name, shown_as=f"{output.name} ({K_QUANT_SOURCE})")
                log.info("llama.cpp quantizes %s to %s", output.name, quant)
                llamacpp.quantize(source, staging, quant)
            finally:
                source.unlink(missing_ok=True)
        else:
            _write_file(staging, state, config, vocab, quant, name, shown_as=output.name)
        _report_tokenizer(staging, tokenizer, vocab)
        os.replace(staging, output)
    except BaseException:
        staging.unlink(missing_ok=True)
        raise
    log.info("wrote %s (%s, %.1f MB)", output, quant, output.stat().st_size / 1e6)
    return output


def _write_file(path: Path, state, config, vocab: GGUFVocab, quant: str, name: str, shown_as: str) -> None:
    """Write the GGUF file ``path`` (a staging name); the progress bar shows ``shown_as``, the file the user asked for."""
    import gguf

    family = family_of(config)
    plan = plan_tensors(state, config, quant, family)
    writer = gguf.GGUFWriter(None, family.arch)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name)
    add_hyperparameters(writer, config, family)
    add_file_type(writer, quant)
    add_vocab(writer, vocab)
    F32, F16 = gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16
    for entry in plan:
        if entry.qtype in (F32, F16):
            dtype = np.float32 if entry.qtype == F32 else np.float16
            writer.add_tensor_info(entry.gguf_name, entry.shape, np.dtype(dtype), int(np.prod(entry.shape)) * np.dtype(dtype).itemsize)
        else:
            byte_shape = gguf.quant_shape_to_byte_shape(entry.shape, entry.qtype)
            writer.add_tensor_info(entry.gguf_name, byte_shape, np.dtype(np.uint8), _byte_count(entry.shape, entry.qtype), raw_dtype=entry.qtype)
    try:
        writer.write_header_to_file(path=path)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        with progress_bar(len(plan), f"write {shown_as}", unit="tensor") as bar:
            for entry in plan:
                writer.write_tensor_data(_tensor_data(entry, state, config))
                bar.update(1)
    finally:
        writer.close()


def _report_tokenizer(path: Path, tokenizer, vocab: GGUFVocab) -> None:
    """Say how far llama.cpp will tokenize like transformers: a warning for a tokenizer llama.cpp does not know
    or for check texts it splits differently (asked of llama.cpp itself when its binding is installed)."""
    texts = [pre_tokenizer_table()["check_text"], *TOKENIZER_CHECK_TEXTS]
    differing = llamacpp.tokenization_differences(path, tokenizer, texts) if llamacpp.available() else None
    checked = "" if differing is None else (
        f"; llama.cpp tokenized {len(differing)} of {len(texts)} check texts differently, e.g. {differing[0][:40]!r}" if differing
        else f"; llama.cpp tokenized all {len(texts)} check texts the same"
    )
    if vocab.unknown_pre_hash:
        log.warning(
            "GGUF export: llama.cpp's converter table does not know this tokenizer (check hash %s...), so the file names "
            "llama.cpp's `%s` pre-tokenizer and llama.cpp may split text into other tokens than transformers does%s",
            vocab.unknown_pre_hash[:12], vocab.pre, checked,
        )
    elif differing:
        log.warning("GGUF export: pre-tokenizer `%s`%s", vocab.pre, checked)
    else:
        log.info("tokenizer: llama.cpp pre-tokenizer `%s`%s", vocab.pre, checked)


def check_gguf_output(output: Path, overwrite: bool) -> None:
    if output.suffix.lower() != ".gguf":
        raise FtctlError(f"output={output}: a GGUF export is one file; give it a name ending in .gguf")
    if output.is_dir():
        raise FtctlError(f"output={output} is a directory; give the GGUF file's path, ending in .gguf")
    if output.exists() and not overwrite:
        raise FtctlError(f"output={output} exists; choose another name or pass overwrite=true")
    check_output_path(output, "output")
