"""Perplexity of held-out data over exactly the tokens training trains: ``exp(mean token cross-entropy)``.

The records are rendered and masked by the training tokenizer (:func:`ftctl.data.dataset.tokenize_records`:
the chat template, the system prompt, ``train_on_prompt``, ``max_seq_len``), batched by the training
collator and scored by the training loss (:func:`ftctl.training.loss.token_loss_sum`), so the mean
is the ``eval_loss`` a run logs on the same data, and the perplexity is its exponential. The mean is
over tokens, not over examples: a long answer weighs by its length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from ftctl.data.batching import Batching
from ftctl.training.loss import token_loss_sum


@dataclass
class Perplexity:
    perplexity: float
    loss: float  # mean cross-entropy per scored token, in nats
    tokens: int  # answer tokens scored
    examples: int  # examples scored (those with no trained token left are dropped, as in training)
    truncated: int  # examples cut to max_seq_len

    def as_dict(self) -> dict:
        return {"perplexity": self.perplexity, "loss": self.loss, "tokens": self.tokens, "examples": self.examples,
                "truncated": self.truncated}


@torch.no_grad()
def perplexity(model, tokenizer, records, source, data_format: str, data_cfg, batch_size: int = 16) -> Perplexity:
    """``records`` (ftctl.data.records.Record) of ``source`` in ``data_format``, tokenized under ``data_cfg``."""
    from ftctl.data.dataset import tokenize_records

    data = tokenize_records(records, source, data_format, data_cfg, tokenizer)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    total, tokens = torch.zeros((), dtype=torch.float64, device=device), 0
    try:
        for batch in Batching(batch_size, pad_id, data_cfg.pad_to_multiple_of)(data, range(len(data))):
            total += token_loss_sum(model, batch, device).double()
            tokens += batch.trained_tokens
    finally:
        model.train(was_training)
    loss = float(total) / max(tokens, 1)
    return Perplexity(math.exp(min(loss, 700.0)), loss, tokens, len(data), int(data.stats.get("truncated", 0)))
