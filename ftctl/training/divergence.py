"""A run that diverged without a NaN: stopped with the step and the likely cause, its last good checkpoint kept.

Two signatures, read from each step's loss and gradient norm (the values every rank already agrees on):

- **collapse**: the loss sits at ln(vocabulary size), what predicting every token with equal
  probability costs, and the gradient norm is zero. Weights blown up by a far too high learning rate
  saturate the network into this state, and with no gradient it never leaves it.
- **climb**: the loss stays above where the run started (the mean of its first steps, plus a
  margin) for ``train.divergence_window`` steps in a row.

With ``train.stop_on_divergence=false`` the run goes on after one warning.
"""

from __future__ import annotations

import logging
import math
from pathlib import Path
from typing import List, Optional

from ftctl.errors import FtctlError
from ftctl.training.checkpoint import checkpoint_step, complete_checkpoints

log = logging.getLogger("ftctl")

COLLAPSE_STEPS = 3  # steps in a row at the collapse signature: it is exact, so a few make it certain
START_STEPS = 3  # the start loss is the mean of the first steps, so one easy first batch cannot set it low
CLIMB_MARGIN = 0.10  # a share of the start loss that a climbing run stays above
ZERO_GRAD_NORM = 1e-8


class TrainingDiverged(FtctlError):
    pass


def uniform_prediction_loss(model) -> Optional[float]:
    """ln(vocabulary size): the loss of a model that gives every token the same probability."""
    config = getattr(model, "config", None)
    text_config = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = getattr(text_config, "vocab_size", None)
    return math.log(vocab) if isinstance(vocab, int) and vocab > 1 else None


class DivergenceGuard:
    def __init__(self, train_cfg, uniform_loss: Optional[float], run_dir: Path):
        self.stop = train_cfg.stop_on_divergence
        self.window = train_cfg.divergence_window
        self.lr = train_cfg.lr
        self.uniform_loss = uniform_loss
        self.run_dir = Path(run_dir)
        self.first_losses: List[float] = []
        self.collapsed_since: Optional[int] = None
        self.climbing_since: Optional[int] = None
        self.warned = False

    @property
    def suspect_since(self) -> Optional[int]:
        """The first checkpoint step whose weights may be bad: a streak's first loss came from the weights of the
        step before it, so checkpoints of earlier steps are the good ones."""
        streaks = [s for s in (self.collapsed_since, self.climbing_since) if s is not None]
        return min(streaks) - 1 if streaks else None

    def check(self, step: int, loss: float, grad_norm: float) -> None:
        """After step ``step`` (1-based): raise TrainingDiverged when a signature has held long enough."""
        if not math.isfinite(loss):
            return  # the non-finite guard's case
        if len(self.first_losses) < START_STEPS:
            self.first_losses.append(loss)
        collapsed = (self.uniform_loss is not None and abs(loss - self.uniform_loss) <= 1e-3 * self.uniform_loss
                     and math.isfinite(grad_norm) and grad_norm <= ZERO_GRAD_NORM)
        self.collapsed_since = (self.collapsed_since or step) if collapsed else None
        start = sum(self.first_losses) / len(self.first_losses)
        climbing = self.window > 0 and len(self.first_losses) == START_STEPS and loss > start * (1 + CLIMB_MARGIN)
        self.climbing_since = (self.climbing_since or step) if climbing else None
        if self.collapsed_since is not None and step - self.collapsed_since + 1 >= COLLAPSE_STEPS:
            why = (f"the loss has sat at {loss:.4f} = ln(vocabulary size), the uniform prediction, with gradient norm 0 "
                   f"since step {self.collapsed_since}: the weights saturated")
        elif self.climbing_since is not None and step - self.climbing_since + 1 >= self.window:
            why = (f"the loss has stayed above its start ({start:.4f}) for {self.window} steps since step "
                   f"{self.climbing_since}, now {loss:.4f}")
        else:
            return
        self._diverged(step, why)

    def _diverged(self, step: int, why: str) -> None:
        cause = f"the learning rate (train.lr={self.lr:g}) is likely too high for this run"
        if not self.stop:
            if not self.warned:
                log.warning("step %d: the run diverged: %s; %s. Going on (train.stop_on_divergence=false)", step, why, cause)
                self.warned = True
            return
        good = [p for p in complete_checkpoints(self.run_dir) if checkpoint_step(p) < self.suspect_since]
        kept = (f"the last checkpoint from before it is {good[-1]}" if good
                else "no checkpoint was saved before it")
        raise TrainingDiverged(
            f"step {step}: the run diverged: {why}; {cause}. Stopped without saving the diverged weights; {kept}. "
            "Start again with a lower train.lr (or more train.warmup_steps), or pass train.stop_on_divergence=false to go on"
        )
