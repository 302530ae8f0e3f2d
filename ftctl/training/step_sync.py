"""What the ranks agree on at the end of a step, in one tensor: one collective and one host read per step.

A step needs, from every rank: the summed loss, the token counts the metrics report, whether
any loss or gradient was non-finite, whether any rank was asked to stop (a signal reaches one
process), the gradient norm (for clipping and for the non-finite check), and the objective's metric
sums (a preference objective's rewards and log-probs: :class:`ftctl.objectives.base.Tally`). On a GPU each read of a
device value waits for the queue to drain, and each collective is a round trip between ranks, so
they travel together. The engine calls :class:`StepSync` once its gradients are final, with its
own gradient norm; the answer is the global norm (a device tensor, so clipping reads nothing back)
and every total as host numbers, read in one go.

The trained tokens (the objective's units) of the whole global batch are not part of it: every rank knows them before the
step (:meth:`ftctl.data.batching.Batching.step_share`), because the loss of each micro-batch is
normalised by them before its backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Optional, Tuple

import torch

# Positions in the reduced tensor.
_LOSS, _TRAINED, _REAL, _POSITIONS, _NONFINITE, _STOP, _NORM_SQ = range(7)


@dataclass
class StepTotals:
    """A step's totals over all ranks, as host numbers."""

    loss_sum: float  # summed token loss of the global batch
    trained_tokens: int  # as the micro-batches counted them
    real_tokens: int
    positions: int  # computed positions, padding included
    nonfinite_ranks: int  # ranks whose loss or gradients were NaN/inf
    stop_requested: bool  # some rank got SIGTERM/SIGINT
    grad_norm: float
    objective_sums: Tuple[float, ...] = ()  # the objective's metric sums over the global batch


class StepSync:
    """The step's one reduction; call it with the local gradient norm (see the module docstring)."""

    def __init__(self, backend, loss_sum: torch.Tensor, micro_batches, stop_requested: Callable[[], bool], tally=None):
        self.backend, self.loss_sum, self.stop_requested, self.tally = backend, loss_sum, stop_requested, tally
        # Host numbers: counted by the collator.
        self.counts = [sum(b.trained_tokens for b in micro_batches), sum(b.real_tokens for b in micro_batches),
                       sum(b.positions for b in micro_batches)]
        self.totals: Optional[StepTotals] = None

    def __call__(self, local_grad_norm: torch.Tensor, sharded: bool) -> Tuple[torch.Tensor, float]:
        """The global gradient norm, as a device tensor and as a host number.

        ``local_grad_norm``: the norm of this rank's gradients; ``sharded``: each rank holds a part of the
        gradients (FSDP), so the global norm is the root of the summed squares; otherwise every rank
        holds them all (averaged by DDP) and its own norm is the global one.
        """
        device = self.loss_sum.device
        norm = local_grad_norm.to(device=device, dtype=torch.float64).reshape(())
        nonfinite = ~(torch.isfinite(self.loss_sum) & torch.isfinite(norm))
        trained, real, positions, stop = torch.tensor([*self.counts, float(self.stop_requested())],
                                                      dtype=torch.float64).to(device).unbind()
        norm_sq = norm.square() if sharded else torch.zeros((), dtype=torch.float64, device=device)
        local = torch.stack([self.loss_sum.double().reshape(()), trained, real, positions, nonfinite.double(), stop, norm_sq])
        if self.tally is not None:
            local = torch.cat([local, self.tally.device_sums(device)])
        reduced = self.backend.all_reduce_sum(local)
        global_norm = reduced[_NORM_SQ].sqrt() if sharded else norm
        values = torch.cat([reduced, global_norm.reshape(1)]).tolist()  # the step's one host read
        self.totals = StepTotals(values[_LOSS], round(values[_TRAINED]), round(values[_REAL]), round(values[_POSITIONS]),
                                 round(values[_NONFINITE]), values[_STOP] > 0, values[-1], tuple(values[_NORM_SQ + 1:-1]))
        return global_norm.to(local_grad_norm.dtype), values[-1]
