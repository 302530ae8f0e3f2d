"""Write a transformers Llama model and its tokenizer as one GGUF file (llama.cpp, Ollama, LM Studio).

What goes in follows llama.cpp's convert_hf_to_gguf.py for ``LlamaForCausalLM``: the ``llama.*``
hyperparameters, tokenizer metadata (ftctl.export.gguf_vocab), and the tensors under llama.cpp
names (ftctl.export.tensor_names) with q/k rows permuted for its rotary layout. Norm weights and
other 1-D tensors stay F32 whatever the requested type, as llama.cpp keeps them; a matrix whose
rows do not split into q8_0 blocks of 32 falls back to F16.

Tensors are converted one at a time while the file is written, so memory holds the model plus one
converted tensor. The file appears under its name only when complete.
"""

from __future__ import annotations

import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

import numpy as np

from ftctl.errors import FtctlError
from ftctl.export.gguf_vocab import add_vocab, vocab_for_gguf
from ftctl.export.tensor_names import gguf_tensor_name, interleave_rotary_rows
from ftctl.progress import progress_bar

log = logging.getLogger("ftctl")

#: gguf.quant= choices: (llama.cpp file type, tensor type of the matrices).
QUANT_TYPES = {"f32": ("ALL_F32", "F32"), "f16": ("MOSTLY_F16", "F16"), "bf16": ("MOSTLY_BF16", "BF16"), "q8_0": ("MOSTLY_Q8_0", "Q8_0")}
DEFAULT_QUANT = "f16"
#: rope_type values a llama GGUF can express (llama3 through a rope_freqs tensor, as llama.cpp does).
SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3")


def gguf_refusal(config) -> Optional[str]:
    """Why ``config`` cannot be written as a llama GGUF by ftctl, or None when it can."""
    model_type = getattr(config, "model_type", None)
    if model_type != "llama":
        architectures = ", ".join(getattr(config, "architectures", None) or []) or "unknown"
        return (
            f"GGUF export supports Llama-architecture models (model_type llama); this one is {model_type} "
            f"({architectures}). Export format=hf instead, or convert with llama.cpp's convert_hf_to_gguf.py"
        )
    unsupported = []
    if getattr(config, "attention_bias", False) or getattr(config, "mlp_bias", False):
        unsupported.append("attention/MLP bias terms")
    if getattr(config, "hidden_act", "silu") != "silu":
        unsupported.append(f"hidden_act={config.hidden_act}")
    rope_type = rope_settings(config).get("rope_type", "default")
    if rope_type not in SUPPORTED_ROPE_TYPES:
        unsupported.append(f"rope_type={rope_type}")
    if unsupported:
        return f"GGUF export of Llama models without {' or '.join(unsupported)}; this model has them. Export format=hf instead"
    return None


def rope_settings(config) -> dict:
    """The rotary settings whichever way the config spells them (transformers 5 rope_parameters, or rope_scaling + rope_theta)."""
    params = dict(getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {})
    params.setdefault("rope_theta", getattr(config, "rope_theta", None) or 10000.0)
    if "type" in params and "rope_type" not in params:
        params["rope_type"] = params["type"]
    return params


def head_dim(config) -> int:
    return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads


def llama3_rope_factors(config) -> np.ndarray:
    """Per-frequency divisors llama.cpp applies for Llama 3.1-style rope scaling (its rope_freqs tensor)."""
    rope = rope_settings(config)
    dim = head_dim(config)
    freqs = 1.0 / (rope["rope_theta"] ** (np.arange(0, dim, 2, dtype=np.float64) / dim))
    factor = rope.get("factor", 8.0)
    low, high = rope.get("low_freq_factor", 1.0), rope.get("high_freq_factor", 4.0)
    old_context = rope.get("original_max_position_embeddings", 8192)
    low_freq_wavelen, high_freq_wavelen = old_context / low, old_context / high
    factors = []
    for freq in freqs:
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            factors.append(1.0)
        elif wavelen > low_freq_wavelen:
            factors.append(factor)
        else:
            smooth = (old_context / wavelen - low) / (high - low)
            factors.append(1.0 / ((1 - smooth) / factor + smooth))
    return np.asarray(factors, dtype=np.float32)


def add_llama_hyperparameters(writer, config, quant: str) -> None:
    import gguf

    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(getattr(config, "num_key_value_heads", None) or config.num_attention_heads)
    writer.add_rope_dimension_count(head_dim(config))
    writer.add_key_length(head_dim(config))
    writer.add_value_length(head_dim(config))
    rope = rope_settings(config)
    writer.add_rope_freq_base(float(rope["rope_theta"]))
    if rope.get("rope_type") == "linear":
        writer.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        writer.add_rope_scaling_factor(float(rope["factor"]))
    writer.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    writer.add_vocab_size(config.vocab_size)
    writer.add_file_type(getattr(gguf.LlamaFileType, QUANT_TYPES[quant][0]))
    if quant not in ("f32", "f16"):
        writer.add_quantization_version(gguf.GGML_QUANT_VERSION)


@dataclass
class _PlannedTensor:
    gguf_name: str
    source: str  # the transformers state_dict key, or "" for a tensor computed here
    heads: Optional[int]  # rows are permuted over this many heads
    shape: tuple
    qtype: object  # gguf.GGMLQuantizationType


def _tensor_type(shape: tuple, target, name: str):
    import gguf

    F32, F16 = gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16
    if len(shape) < 2:
        return F32
    block = gguf.GGML_QUANT_SIZES[target][0]
    if shape[-1] % block:
        log.info("%s: rows of %d do not split into %s blocks of %d; written as F16", name, shape[-1], target.name, block)
        return F16
    return target


def _byte_count(shape: tuple, qtype) -> int:
    import gguf

    return int(np.prod(gguf.quant_shape_to_byte_shape(shape, qtype)))


def plan_tensors(state: Dict[str, "object"], config, quant: str) -> List[_PlannedTensor]:
    """Every GGUF tensor with its source, permutation and type; unknown source tensors are an error."""
    import gguf

    target = getattr(gguf.GGMLQuantizationType, QUANT_TYPES[quant][1])
    tied = bool(getattr(config, "tie_word_embeddings", False))
    plan, unknown = [], []
    for key, tensor in state.items():
        if tied and key == "lm_head.weight":
            continue  # llama.cpp reuses token_embd when output.weight is absent
        name, heads_key = gguf_tensor_name(key)
        if name is None:
            unknown.append(key)
            continue
        heads = (getattr(config, heads_key, None) or config.num_attention_heads) if heads_key else None
        shape = tuple(tensor.shape)
        plan.append(_PlannedTensor(name, key, heads, shape, _tensor_type(shape, target, name)))
    if unknown:
        raise FtctlError(f"GGUF export: {len(unknown)} tensors have no place in a llama GGUF file, e.g. {', '.join(unknown[:3])}")
    if rope_settings(config).get("rope_type") == "llama3":
        plan.append(_PlannedTensor("rope_freqs.weight", "", None, (head_dim(config) // 2,), gguf.GGMLQuantizationType.F32))
    return plan


def _tensor_data(entry: _PlannedTensor, state, config) -> np.ndarray:
    import gguf
    import torch

    if not entry.source:
        return llama3_rope_factors(config)
    array = state[entry.source].detach().to(device="cpu", dtype=torch.float32).numpy()
    if entry.heads:
        array = interleave_rotary_rows(array, entry.heads)
    return gguf.quants.quantize(np.ascontiguousarray(array), entry.qtype)


def write_gguf(model, tokenizer, output, quant: str = DEFAULT_QUANT, *, name: Optional[str] = None, overwrite: bool = False) -> Path:
    """Write ``model`` (a transformers Llama) with ``tokenizer`` to the GGUF file ``output``; return its path."""
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
    plan = plan_tensors(state, config, quant)

    writer = gguf.GGUFWriter(None, "llama")
    writer.add_type(gguf.GGUFType.MODEL)
    writer.add_name(name or output.stem)
    add_llama_hyperparameters(writer, config, quant)
    add_vocab(writer, vocab)
    F32, F16 = gguf.GGMLQuantizationType.F32, gguf.GGMLQuantizationType.F16
    for entry in plan:
        if entry.qtype in (F32, F16):
            dtype = np.float32 if entry.qtype == F32 else np.float16
            writer.add_tensor_info(entry.gguf_name, entry.shape, np.dtype(dtype), int(np.prod(entry.shape)) * np.dtype(dtype).itemsize)
        else:
            byte_shape = gguf.quant_shape_to_byte_shape(entry.shape, entry.qtype)
            writer.add_tensor_info(entry.gguf_name, byte_shape, np.dtype(np.uint8), _byte_count(entry.shape, entry.qtype), raw_dtype=entry.qtype)

    output.parent.mkdir(parents=True, exist_ok=True)
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
