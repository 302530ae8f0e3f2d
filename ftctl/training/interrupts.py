"""SIGTERM and SIGINT stop a run at the next step boundary, after a checkpoint, instead of mid-step."""

from __future__ import annotations

import logging
import math
import signal
from dataclasses import dataclass
from typing import Callable, Optional, Tuple

from ftctl.errors import FtctlError


class TrainingInterrupted(FtctlError):
    exit_code = 143


class NonFiniteTraining(FtctlError):
    def __init__(self, step, loss, grad_norm, kept_checkpoint, precision: str = "fp32", lr: Optional[float] = None):
        kept = f"the last good state is saved in {kept_checkpoint}" if kept_checkpoint else "no step had completed yet"
        super().__init__(
            f"step {step}: non-finite training (loss {loss}, gradient norm {grad_norm}); {kept}. {nonfinite_advice(precision, lr)}, "
            "or allow skipping with train.max_nonfinite_steps=N"
        )


def nonfinite_advice(precision: str, lr: Optional[float] = None) -> str:
    """What to change, for this run: fp32 is advice only to a run that is not already fp32."""
    lower = f"Lower train.lr{f' (now {lr:g})' if lr is not None else ''} or lengthen train.warmup_steps"
    if precision == "fp32":
        return lower + " (this run is fp32 already: the numbers themselves grew out of range)"
    if precision == "fp16":
        return lower + ", or train in bf16 (where the hardware has it) or fp32, whose range fp16 lacks"
    return lower + ", or train in precision=fp32"


@dataclass
class StepOutcome:
    loss: float  # mean loss of the global batch over the objective's units (SFT: trained tokens)
    grad_norm: float
    skipped: bool  # the engine applied no update
    global_tokens: int  # trained tokens of the global batch
    real_tokens: int = 0  # non-padding tokens of the global batch
    positions: int = 0  # computed positions of the global batch, padding included
    stop_requested: bool = False  # some rank got SIGTERM/SIGINT before the step's end
    units: Optional[int] = None  # what ``loss`` is a mean over (preference objectives: examples); None: global_tokens
    objective_sums: Tuple[float, ...] = ()  # the objective's metric sums over the global batch (ftctl.objectives.base.Tally)

    @property
    def loss_units(self) -> int:
        return self.global_tokens if self.units is None else self.units


class NonFiniteGuard:
    """Counts steps whose loss or gradients are NaN/inf and stops the run past the allowed number.

    The engines never apply such an update, so when the guard stops the run the weights are still
    the last good ones, and ``keep_last_good`` saves them. fp16 overflows are the scaler's business.
    """

    def __init__(self, allowed: int, scaler_handles_overflow: bool, precision: str = "fp32", lr: Optional[float] = None):
        self.allowed, self.scaler_handles_overflow, self.seen = allowed, scaler_handles_overflow, 0
        self.precision, self.lr = precision, lr

    def check(self, step: int, outcome: StepOutcome, keep_last_good: Callable[[], Optional[object]]) -> None:
        bad_grads = not self.scaler_handles_overflow and not math.isfinite(outcome.grad_norm)
        if math.isfinite(outcome.loss) and not bad_grads:
            return
        self.seen += 1
        if self.seen > self.allowed:
            raise NonFiniteTraining(step, outcome.loss, outcome.grad_norm, keep_last_good(), self.precision, self.lr)
        logging.getLogger("ftctl").warning(
            "step %d: non-finite loss or gradients; update skipped (%d of %d allowed)", step, self.seen, self.allowed
        )


class StopRequest:
    """Remembers a termination signal; every rank agrees on stopping through the step's one reduction
    (:mod:`ftctl.training.step_sync`), which asks :meth:`requested_here`."""

    def __init__(self):
        self.signal_name = None
        self._previous = {}

    def __enter__(self):
        for sig in (signal.SIGTERM, signal.SIGINT):
            try:
                self._previous[sig] = signal.signal(sig, self._handle)
            except ValueError:  # not the main thread: leave signals to the caller
                pass
        return self

    def __exit__(self, *exc):
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        return False

    def _handle(self, signum, frame):
        if self.signal_name is not None and signum == signal.SIGINT:
            raise KeyboardInterrupt  # a second Ctrl-C stops at once
        self.signal_name = signal.Signals(signum).name

    def requested_here(self) -> bool:
        """Whether this process got the signal (the other ranks may not have)."""
        return self.signal_name is not None
