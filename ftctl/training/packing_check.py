"""Packing is trusted only where the loaded model keeps packed examples apart: checked on the model itself.

A packed row carries no attention mask; positions restart at every example, and transformers builds
the block-diagonal causal mask from them (packed SDPA and flash-attention use the boundaries
instead). A model whose forward builds its masks without ``position_ids`` (GPT-OSS is the known
case) lets every example see the ones before it in the row: the loss is silently wrong. So before
training with ``data.packing=true`` two short examples run once packed into one row and once each
on its own, through the very model (kernel, adapters, dtype) training will use; when the second
example's logits differ, training is refused. Two forwards of a few tokens: milliseconds.
"""

from __future__ import annotations

import torch

from ftctl.data.batching import collate, pack_examples
from ftctl.errors import FtctlError

# Token ids every vocabulary has; the examples only need to differ from each other.
_FIRST = [3, 11, 7, 19, 5, 23, 2, 13]
_SECOND = [17, 4, 29, 6, 31, 9]


def _logits(model, batch, device) -> torch.Tensor:
    return model(**batch.model_inputs(device), use_cache=False).logits.float()


def packed_logit_gap(model: torch.nn.Module, pad_token_id: int, compute_dtype: torch.dtype = torch.float32) -> float:
    """Largest difference, relative to the logits' scale, between the second example's logits packed and alone."""
    device = next(model.parameters()).device
    vocab = model.get_input_embeddings().weight.shape[0]
    first, second = [i % vocab for i in _FIRST], [i % vocab for i in _SECOND]
    examples = [(first, first), (second, second)]
    was_training = model.training
    model.eval()  # dropout off, so the two forwards can agree exactly
    try:
        with torch.no_grad(), torch.autocast(device.type, dtype=compute_dtype, enabled=compute_dtype != torch.float32):
            packed = _logits(model, pack_examples(examples, len(first) + len(second), pad_token_id, 1), device)
            alone = _logits(model, collate([examples[1]], pad_token_id, 1), device)
    finally:
        model.train(was_training)
    start = len(first)
    gap = (packed[0, start:start + len(second)] - alone[0, : len(second)]).abs().max()
    return float(gap / alone.abs().max().clamp(min=1.0))


def check_packing(model: torch.nn.Module, pad_token_id: int, compute_dtype: torch.dtype) -> None:
    """Refuse ``data.packing=true`` for a model whose packed examples see each other (see the module docstring)."""
    gap = packed_logit_gap(model, pad_token_id, compute_dtype)
    # Per-example and whole-row kernels round differently; bf16/fp16 round far more. Leaking attention moves
    # logits by a sizeable fraction of their scale, well above either bound.
    tolerance = 1e-3 if compute_dtype == torch.float32 else 3e-2
    if not gap <= tolerance:
        name = type(_unwrapped(model)).__name__
        raise FtctlError(
            f"{name} mixes packed examples: its logits for an example packed after another differ from the "
            f"example alone by {gap:.2g} of their scale (its attention ignores the restarting position_ids); "
            f"train it with data.packing=false"
        )


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    base = getattr(model, "get_base_model", None)
    return base() if callable(base) else model
