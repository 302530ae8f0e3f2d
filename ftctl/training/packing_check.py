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
from ftctl.models.packed_attention import record_packed_kernels, use_packed_attention

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


def check_packing(model: torch.nn.Module, pad_token_id: int, compute_dtype: torch.dtype) -> set:
    """Refuse ``data.packing=true`` for a model whose packed examples see each other (see the module docstring).

    Returns the packed attention kernels that ran in the check (none when the model keeps its own attention).
    """
    with record_packed_kernels() as ran:
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
    return ran


def packed_training_gap(model: torch.nn.Module, kernel: str, examples, row_len: int, pad_token_id: int,
                        compute_dtype: torch.dtype = torch.float32) -> dict:
    """One kernel checked as training uses it: the summed token loss and every gradient of ``examples``
    packed into rows of ``row_len`` through ``kernel``, against the same examples padded.

    ``model`` is loaded with ``sdpa`` attention (padded batches run it) and is switched to ``kernel``
    here, for good. Returns the relative difference of the loss (``loss``), the largest relative
    difference of a parameter's gradient (``grads``, by norm) and the packed kernels that ran (``ran``).
    Dropout is off.
    """
    from ftctl.training.loss import token_loss_sum

    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    results = []
    try:
        for batch in (collate(examples, pad_token_id), None):
            if batch is None:
                if not use_packed_attention(model, kernel):
                    raise ValueError(f"packed attention replaces sdpa; the model runs {model.config._attn_implementation}")
                batch = pack_examples(examples, row_len, pad_token_id)
            model.zero_grad(set_to_none=True)
            with record_packed_kernels() as ran, torch.autocast(device.type, dtype=compute_dtype,
                                                               enabled=compute_dtype != torch.float32):
                loss = token_loss_sum(model, batch, device)
                loss.backward()
            grads = {n: p.grad.detach().float().clone() for n, p in model.named_parameters() if p.grad is not None}
            results.append((loss.detach().double(), grads, ran))
    finally:
        model.zero_grad(set_to_none=True)
        model.train(was_training)
    (padded, padded_grads, _), (packed, packed_grads, ran) = results
    if set(padded_grads) != set(packed_grads) or not padded_grads:
        raise ValueError("packed and padded runs trained different parameters")
    grads = max(float((packed_grads[n] - g).norm() / g.norm().clamp(min=1e-12)) for n, g in padded_grads.items())
    return {"loss": float((packed - padded).abs() / padded.abs()), "grads": grads, "ran": ran}


def _unwrapped(model: torch.nn.Module) -> torch.nn.Module:
    base = getattr(model, "get_base_model", None)
    return base() if callable(base) else model
