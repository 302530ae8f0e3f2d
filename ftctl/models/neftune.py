"""NEFTune (Jain et al., 2023, "NEFTune: Noisy Embeddings Improve Instruction Finetuning").

In every training forward, uniform noise from [-m, m] with m = alpha / sqrt(L · d) is added to the
input embeddings, L being the sequence length and d the hidden size. As in TRL and transformers'
Trainer, L is the width of the batch's rows (padded, or packed to max_seq_len), and the noise is
added only while the embedding module is in training mode: evaluation (``module.eval()``) and
generation see the embeddings unchanged. The noise is drawn from torch's generator of the device,
whose state checkpoints save, so a resumed run draws the same noise.
"""

from __future__ import annotations

import math

import torch


def neftune_magnitude(alpha: float, length: int, hidden: int) -> float:
    """Half-width of NEFTune's uniform noise for rows of ``length`` tokens of ``hidden`` features."""
    return alpha / math.sqrt(length * hidden)


def add_neftune_noise(model: torch.nn.Module, alpha: float) -> torch.utils.hooks.RemovableHandle:
    """Make ``model``'s input embeddings noisy in training forwards; returns the hook's handle (``.remove()`` undoes it)."""
    embeddings = model.get_input_embeddings()

    def noisy(module: torch.nn.Module, args, output: torch.Tensor) -> torch.Tensor:
        if not module.training:
            return output
        magnitude = neftune_magnitude(alpha, output.shape[-2], output.shape[-1])
        return output + torch.empty_like(output).uniform_(-magnitude, magnitude)

    return embeddings.register_forward_hook(noisy)
