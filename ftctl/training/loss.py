"""The loss: a sum of token cross-entropies, so the caller can normalise by the global batch's trained tokens."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ftctl.data.render import IGNORE_INDEX


def token_loss_sum(module: torch.nn.Module, batch, device: torch.device) -> torch.Tensor:
    input_ids = batch.input_ids.to(device, non_blocking=True)
    attention_mask = batch.attention_mask.to(device, non_blocking=True)
    labels = batch.labels.to(device, non_blocking=True)
    logits = module(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
    return F.cross_entropy(
        logits[:, :-1].float().reshape(-1, logits.size(-1)),
        labels[:, 1:].reshape(-1),
        ignore_index=IGNORE_INDEX,
        reduction="sum",
    )
