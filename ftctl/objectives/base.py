"""The interface every objective implements, and ``sft``, the next-token cross-entropy of today.

The runner drives one loop whatever the objective; what differs is asked of the objective: which
data it reads and how a micro-batch is laid out, what it needs before the first step (a reference
model), what a step's loss is a mean over (trained tokens for SFT, examples for preference
objectives), the summed loss of one micro-batch, and the metrics it adds to a log line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Sequence, Tuple

import torch

from ftctl.config.schema import RunConfig
from ftctl.training.loss import token_loss_sum


@dataclass
class ObjectiveSetup:
    """What an objective may use before the first step: the model as built and as wrapped, and the data."""

    method: object  # the run's method: builds a second model as the first was built (attention included)
    model: torch.nn.Module  # as the method built it, before the backend wrapped it
    engine: object  # the backend's engine; engine.module is what a forward goes through
    model_path: str
    backend: object
    precision: object
    datasets: List[Tuple[str, object]]  # ("train", the train split), then each eval set by its metrics key
    make_batches: object
    resumed: bool  # the run continues from a checkpoint: its weights are no longer the starting ones


class Objective:
    name = ""

    def __init__(self, cfg: Optional[RunConfig] = None):
        self.cfg = cfg

    def build_datasets(self, tokenizer, seed: int):
        """(train, eval or None) as this objective reads them."""
        raise NotImplementedError

    def build_eval_sets(self, tokenizer) -> dict:
        """data.eval_sets as this objective reads them, by name."""
        raise NotImplementedError

    def batching(self, pad_token_id: int):
        """How a list of example indices becomes micro-batches (and a step's share, with the global batch's units)."""
        raise NotImplementedError

    def prepare(self, setup: ObjectiveSetup) -> None:
        """Anything needed before the first step (a reference model, precomputed log-probs)."""

    def units(self, batch) -> int:
        """What the step's loss is a mean over, counted in ``batch``: summed over the global batch, it normalises."""
        raise NotImplementedError

    def begin_step(self, module: torch.nn.Module, batches, backend) -> None:
        """Called once per step before its micro-batches, on every rank (KTO's KL estimate)."""

    def new_tally(self):
        """A fresh :class:`Tally` for this objective's metric sums (a step, or an eval pass), or None when it has none."""
        return None

    def loss_sum(self, module: torch.nn.Module, batch, device, tally=None) -> torch.Tensor:
        """The micro-batch's loss summed over its units; its metric sums go to ``tally``."""
        raise NotImplementedError

    def step_metrics(self, sums: Sequence[float], prefix: str = "") -> dict:
        """The metrics of tally sums (summed over ranks and steps, as host numbers): means, keyed ``prefix + name``."""
        return {}


class Tally:
    """Metric sums of a step or an eval pass: device values (never read until the step's one reduction) and host counts."""

    def __init__(self, device_values: int, host_counts: int):
        self.device_values, self.host_counts = device_values, host_counts
        self.values: Optional[torch.Tensor] = None
        self.counts = [0.0] * host_counts

    def add(self, values: torch.Tensor, *counts: float) -> None:
        values = values.detach().double()
        self.values = values if self.values is None else self.values + values
        self.counts = [a + b for a, b in zip(self.counts, counts)]

    def device_sums(self, device) -> torch.Tensor:
        """Every sum as one float64 tensor on ``device``: the device values, then the host counts (copied, not read)."""
        values = self.values if self.values is not None else torch.zeros(self.device_values, dtype=torch.float64, device=device)
        return torch.cat([values.to(device), torch.tensor(self.counts, dtype=torch.float64).to(device)])

    def local_sums(self) -> torch.Tensor:
        """:meth:`device_sums` on the host (an eval pass: read once at its end)."""
        return self.device_sums(torch.device("cpu"))


class SFT(Objective):
    """Next-token cross-entropy on the answers, normalised by the global batch's trained tokens."""

    name = "sft"

    def build_datasets(self, tokenizer, seed):
        from ftctl.data.dataset import build_datasets

        return build_datasets(self.cfg.data, tokenizer, seed)

    def build_eval_sets(self, tokenizer):
        from ftctl.data.dataset import build_eval_sets

        return build_eval_sets(self.cfg.data, tokenizer)

    def batching(self, pad_token_id):
        from ftctl.data.batching import Batching

        return Batching.from_config(self.cfg, pad_token_id)

    def units(self, batch):
        return batch.trained_tokens

    def loss_sum(self, module, batch, device, tally=None):
        return token_loss_sum(module, batch, device)
