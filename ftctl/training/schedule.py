"""The run's length and learning-rate schedule: linear warmup, then cosine, linear or no decay.

Both are functions of the step and the run's total steps, so a resumed run gets them back from the
step alone, and a run extended to more steps recomputes them for its new total.
"""

from __future__ import annotations

import math

from ftctl.config.schema import DEFAULT_MAX_STEPS, TrainConfig


def total_steps(t: TrainConfig, num_train_examples: int) -> int:
    """train.max_steps, or train.epochs passes over the training examples (a partial last step counts)."""
    if t.epochs is not None:
        return max(1, math.ceil(t.epochs * num_train_examples / t.global_batch_size))
    return t.max_steps if t.max_steps is not None else DEFAULT_MAX_STEPS


def warmup_steps(t: TrainConfig, total: int) -> int:
    return math.ceil(t.warmup_ratio * total) if t.warmup_ratio else t.warmup_steps


def learning_rate(step: int, t: TrainConfig, total: int) -> float:
    """The lr of 0-based ``step`` in a run of ``total`` steps."""
    warmup = warmup_steps(t, total)
    if step < warmup:
        return t.lr * (step + 1) / warmup
    if t.lr_scheduler == "constant":
        return t.lr
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    floor = t.lr * t.min_lr_ratio
    shape = 1.0 - progress if t.lr_scheduler == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return floor + (t.lr - floor) * shape
