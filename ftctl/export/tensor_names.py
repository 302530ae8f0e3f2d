"""Where each transformers tensor goes in a GGUF file, and the row order llama.cpp's llama graph wants.

Names come from gguf-py's table for the target architecture (``gguf.get_tensor_name_map``): the one
llama.cpp's converter writes with and transformers' GGUF loader reads back with. A tensor the
architecture has no place for gets no name, and the export refuses it rather than drop it.

``q_proj`` and ``k_proj`` of the llama architecture also change row order: transformers rotates the
two halves of each head (``rotate_half``), llama.cpp's llama graph rotates interleaved pairs, so their
rows are permuted per head on the way out (and transformers' loader reverses it on the way in).
"""

from __future__ import annotations

import functools
from typing import Optional, Tuple

import numpy as np

#: transformers' fused expert gate and up projections (experts, 2 × expert width, hidden), split for llama.cpp.
FUSED_EXPERTS = "mlp.experts.gate_up_proj"
#: Block tensors whose rows are permuted for the llama graph's rotary layout, and which head count applies.
ROTARY_PERMUTED = {"self_attn.q_proj.weight": "num_attention_heads", "self_attn.k_proj.weight": "num_key_value_heads"}


@functools.lru_cache(maxsize=None)
def _name_map(arch: str, block_count: int):
    import gguf

    arch_id = next(key for key, name in gguf.MODEL_ARCH_NAMES.items() if name == arch)
    return gguf.get_tensor_name_map(arch_id, block_count)


def gguf_tensor_name(hf_name: str, arch: str = "llama", block_count: int = 1, permute_rotary: bool = True) -> Tuple[Optional[str], Optional[str]]:
    """(GGUF name, head-count key when rows must be permuted); (None, None) for a tensor with no place in ``arch``."""
    base, _, suffix = hf_name.rpartition(".")
    if suffix not in ("weight", "bias"):  # a bare parameter, such as fused experts: llama.cpp calls it a weight
        base, suffix = hf_name, "weight"
    name = _name_map(arch, block_count).get_name(base)
    if name is None:
        return None, None
    heads_key = next((key for end, key in ROTARY_PERMUTED.items() if hf_name.endswith(end)), None) if permute_rotary else None
    return f"{name}.{suffix}", heads_key


def split_tensor_names(hf_name: str, arch: str, block_count: int) -> Optional[Tuple[str, str]]:
    """The two GGUF names of a fused experts ``gate_up_proj`` (gate rows first, then up), or None for any other tensor."""
    if not hf_name.endswith(FUSED_EXPERTS):
        return None
    stem = hf_name[: -len("gate_up_proj")]
    gate, up = (gguf_tensor_name(stem + part, arch, block_count)[0] for part in ("gate_proj", "up_proj"))
    return (gate, up) if gate and up else None


def interleave_rotary_rows(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Reorder each head's rows from halves (x0..x(d/2-1), y0..) to pairs (x0, y0, x1, y1, ...), as llama.cpp expects."""
    rows = weight.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"{rows} rows do not split into {n_head} heads of rotary pairs")
    return weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
