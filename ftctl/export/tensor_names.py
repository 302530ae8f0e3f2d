"""Where each transformers Llama tensor goes in a GGUF file: the one place this mapping lives.

The names are llama.cpp's (gguf-py ``MODEL_TENSOR`` names for ``MODEL_ARCH.LLAMA``), the ones
transformers' GGUF loader maps back. ``q_proj`` and ``k_proj`` also change row order: transformers
rotates the two halves of each head (``rotate_half``), llama.cpp rotates interleaved pairs, so their
rows are permuted per head on the way out (and transformers' loader reverses it on the way in).
"""

from __future__ import annotations

import re
from typing import Optional, Tuple

import numpy as np

#: transformers name -> GGUF name, for tensors outside the decoder blocks.
GLOBAL_TENSORS = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}

#: transformers name inside ``model.layers.N.`` -> GGUF name inside ``blk.N.``.
BLOCK_TENSORS = {
    "input_layernorm.weight": "attn_norm.weight",
    "self_attn.q_proj.weight": "attn_q.weight",
    "self_attn.k_proj.weight": "attn_k.weight",
    "self_attn.v_proj.weight": "attn_v.weight",
    "self_attn.o_proj.weight": "attn_output.weight",
    "post_attention_layernorm.weight": "ffn_norm.weight",
    "mlp.gate_proj.weight": "ffn_gate.weight",
    "mlp.up_proj.weight": "ffn_up.weight",
    "mlp.down_proj.weight": "ffn_down.weight",
}

#: Block tensors whose rows are permuted for llama.cpp's rotary layout, and which head count applies.
ROTARY_PERMUTED = {"self_attn.q_proj.weight": "num_attention_heads", "self_attn.k_proj.weight": "num_key_value_heads"}

_BLOCK = re.compile(r"^model\.layers\.(\d+)\.(.+)$")


def gguf_tensor_name(hf_name: str) -> Tuple[Optional[str], Optional[str]]:
    """(GGUF name, head-count key when rows must be permuted); (None, None) for a tensor with no GGUF place."""
    if hf_name in GLOBAL_TENSORS:
        return GLOBAL_TENSORS[hf_name], None
    match = _BLOCK.match(hf_name)
    if match and match.group(2) in BLOCK_TENSORS:
        return f"blk.{match.group(1)}.{BLOCK_TENSORS[match.group(2)]}", ROTARY_PERMUTED.get(match.group(2))
    return None, None


def interleave_rotary_rows(weight: np.ndarray, n_head: int) -> np.ndarray:
    """Reorder each head's rows from halves (x0..x(d/2-1), y0..) to pairs (x0, y0, x1, y1, ...), as llama.cpp expects."""
    rows = weight.shape[0]
    if rows % (2 * n_head):
        raise ValueError(f"{rows} rows do not split into {n_head} heads of rotary pairs")
    return weight.reshape(n_head, 2, rows // n_head // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)
