"""SIGTERM and SIGINT stop a run at the next step boundary, after a checkpoint, instead of mid-step."""

from __future__ import annotations

import signal

import torch

from ftctl.errors import FtctlError


class TrainingInterrupted(FtctlError):
    exit_code = 143


class NonFiniteTraining(FtctlError):
    def __init__(self, step, loss, grad_norm, kept_checkpoint):
        kept = f"the last good state is saved in {kept_checkpoint}" if kept_checkpoint else "no step had completed yet"
        super().__init__(
            f"step {step}: non-finite training (loss {loss}, gradient norm {grad_norm}); {kept}. Lower train.lr, "
            "use precision=fp32, or allow skipping with train.max_nonfinite_steps=N"
        )


class StopRequest:
    """Remembers a termination signal; every rank agrees on stopping through one all-reduce per step."""

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

    def requested(self, backend) -> bool:
        flag = torch.tensor(1.0 if self.signal_name else 0.0)
        return bool(backend.all_reduce_sum(flag) > 0)
