"""Write a transformers model and its tokenizer as one GGUF file (llama.cpp, Ollama, LM Studio).

What goes in follows llama.cpp's convert_hf_to_gguf.py for the model's family
(ftctl.export.gguf_families: Llama, Mistral, Mixtral, Qwen2, Qwen3, Qwen3-MoE, Gemma 2, Gemma 3,
Phi-3): the ``{arch}.*`` hyperparameters, tokenizer metadata (ftctl.export.gguf_vocab), and the
tensors under llama.cpp names (ftctl.export.tensor_names) in the family's conventions. Norm weights,
expert routers and other 1-D tensors stay F32 whatever the requested type, as llama.cpp keeps them;
a matrix whose rows do not split into q8_0 blocks of 32 falls back to F16.

Tensors are converted one at a time while the file is written, so memory holds the model plus one
converted tensor. The file appears under its name only when complete.
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
from ftctl.export.gguf_vocab import add_vocab, vocab_for_gguf
from ftctl.export.tensor_names import gguf_tensor_name, interleave_rotary_rows, split_tensor_names
from ftctl.paths import check_output_path, make_parent
from ftctl.progress import progress_bar

log = logging.getLogger("ftctl")

#: gguf.quant= choices: (llama.cpp file type, tensor type of the matrices).
QUANT_TYPES = {"f32": ("ALL_F32", "F32"), "f16": ("MOSTLY_F16", "F16"), "bf16": ("MOSTLY_BF16", "BF16"), "q8_0": ("MOSTLY_Q8_0", "Q8_0")}
DEFAULT_QUANT = "f16"
ROUTER_SUFFIX = "ffn_gate_inp.weight"


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
    import gguf

    if quant not in QUANT_TYPES:
        raise FtctlError(f"gguf.quant={quant} is not one of {', '.join(QUANT_TYPES)}")
    output = Path(output).expanduser().absolute()
    check_gguf_output(output, overwrite)
    config = model.config
    refusal = gguf_refusal(config)
    if refusal:
        raise FtctlError(refusal)
    vocab = vocab_for_gguf(tokenizer, config.vocab_size)
    state = model.state_dict()
    family = family_of(config)
    plan = plan_tensors(state, config, quant, family)

    writer = gguf.GGUFWriter(None, family.arch)
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name or output.stem)
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

    make_parent(output, "output")
    staging = output.with_name(f".{output.name}.partial-{os.getpid()}")
    try:
        writer.write_header_to_file(path=staging)
        writer.write_kv_data_to_file()
        writer.write_ti_data_to_file()
        with progress_bar(len(plan), f"write {output.name}", unit="tensor") as bar:
            for entry in plan:
                writer.write_tensor_data(_tensor_data(entry, state, config))
                bar.update(1)
        writer.close()
        os.replace(staging, output)
    except BaseException:
        writer.close()
        staging.unlink(missing_ok=True)
        raise
    log.info("wrote %s (%s, %d tensors, %.1f MB)", output, quant, len(plan), output.stat().st_size / 1e6)
    return output


def check_gguf_output(output: Path, overwrite: bool) -> None:
    if output.suffix.lower() != ".gguf":
        raise FtctlError(f"output={output}: a GGUF export is one file; give it a name ending in .gguf")
    if output.is_dir():
        raise FtctlError(f"output={output} is a directory; give the GGUF file's path, ending in .gguf")
    if output.exists() and not overwrite:
        raise FtctlError(f"output={output} exists; choose another name or pass overwrite=true")
    check_output_path(output, "output")
