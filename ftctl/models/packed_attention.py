"""Attention for packed micro-batches that computes each example on its own, the varlen way, on any device.

A packed row holds several examples back to back. The general way to keep them apart is a
block-diagonal mask over the whole row, but a masked SDPA computes every (query, key) pair of the
row, and the fast kernels that skip the causal half only take ``is_causal`` without a mask. With
examples a quarter of the row long, the masked kernel does about eight times the useful work.

Packed micro-batches therefore also carry the example boundaries in the form flash-attention's
varlen kernels take them (``cu_seq_lens_q``/``cu_seq_lens_k``: cumulative lengths over the
flattened rows, as transformers' padding-free path passes them to every attention call). With
``flash_attention_2`` those go to the varlen kernel as they are; with :data:`PACKED_SDPA`, which
:func:`use_packed_attention` installs in place of ``sdpa``, each example runs through causal SDPA
on its own slice. Batches without boundaries (padded batches, generation) take the plain ``sdpa``
path, mask included.
"""

from __future__ import annotations

from typing import List, Optional, Tuple

import torch
import torch.nn.functional as F

PACKED_SDPA = "ftctl_packed_sdpa"
_registered = False


def register_packed_attention() -> None:
    """Make :data:`PACKED_SDPA` a valid ``attn_implementation`` (idempotent)."""
    global _registered
    if _registered:
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    AttentionInterface.register(PACKED_SDPA, packed_sdpa_attention_forward)
    # Padded batches still need their padding mask; packed ones ignore the one built for them.
    AttentionMaskInterface.register(PACKED_SDPA, sdpa_mask)
    _registered = True


def use_packed_attention(model: torch.nn.Module) -> bool:
    """Switch a model loaded with ``sdpa`` attention to :data:`PACKED_SDPA`; returns whether it did.

    Other implementations stay: flash-attention reads the same boundaries itself, and ``eager``
    (chosen to see attention weights) keeps the block-diagonal mask.
    """
    config = getattr(model, "config", None)
    if config is None or getattr(config, "_attn_implementation", None) != "sdpa":
        return False
    register_packed_attention()
    config._attn_implementation = PACKED_SDPA
    return True


def example_spans(cu_seq_lens: torch.Tensor, rows: int, row_len: int) -> List[Tuple[int, int, int]]:
    """(row, start, end) of every example from cumulative lengths over the flattened rows (padding included)."""
    bounds = cu_seq_lens.tolist()
    if bounds[0] != 0 or bounds[-1] != rows * row_len:
        raise ValueError(f"cu_seq_lens {bounds} do not cover {rows} rows of {row_len} positions")
    spans = []
    for start, end in zip(bounds[:-1], bounds[1:]):
        row, offset = divmod(start, row_len)
        if end - row * row_len > row_len:
            raise ValueError(f"a packed example spans rows {row} and {row + 1}: cu_seq_lens {bounds}")
        spans.append((row, offset, offset + end - start))
    return spans


def packed_sdpa_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: Optional[torch.Tensor],
    dropout: float = 0.0,
    scaling: Optional[float] = None,
    cu_seq_lens_q: Optional[torch.Tensor] = None,
    cu_seq_lens_k: Optional[torch.Tensor] = None,
    **kwargs,
):
    """``sdpa_attention_forward`` with per-example causal attention when boundaries are given.

    query: (batch, heads, length, head_dim); key/value: (batch, kv_heads, length, head_dim).
    Returns (batch, length, heads, head_dim) like transformers' own SDPA path.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    if cu_seq_lens_q is None or query.shape[2] != key.shape[2] or not getattr(module, "is_causal", True):
        return sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout, scaling=scaling, **kwargs)
    if cu_seq_lens_k is not None and not torch.equal(cu_seq_lens_q, cu_seq_lens_k):
        raise ValueError("packed attention needs the same example boundaries for queries and keys")
    gqa = query.shape[1] != key.shape[1]
    lengths: List[List[int]] = [[] for _ in range(query.shape[0])]
    for row, start, end in example_spans(cu_seq_lens_q, query.shape[0], query.shape[2]):
        lengths[row].append(end - start)
    rows = []
    # split() rather than one slice per example: its backward is one concatenation, where every
    # slice's backward would write its gradient into a zeroed tensor the size of the whole input.
    for q_row, k_row, v_row, row_lengths in zip(query.split(1), key.split(1), value.split(1), lengths):
        parts = [
            F.scaled_dot_product_attention(q, k, v, dropout_p=dropout, scale=scaling, is_causal=True, enable_gqa=gqa)
            for q, k, v in zip(q_row.split(row_lengths, 2), k_row.split(row_lengths, 2), v_row.split(row_lengths, 2))
        ]
        rows.append(torch.cat(parts, dim=2))
    return torch.cat(rows, dim=0).transpose(1, 2).contiguous(), None
