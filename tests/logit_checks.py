"""Helpers the model-comparison tests share: fixed inputs, fp32 logits, an fp32 model from a dir."""

from __future__ import annotations

import torch


def sample_ids(vocab: int = 500):
    return torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(0))


@torch.no_grad()
def logits(model):
    return model.eval()(input_ids=sample_ids()).logits.float()


def fp32_model(path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
