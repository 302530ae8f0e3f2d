"""Linear warmup, then cosine decay to ``min_lr_ratio × lr`` at ``max_steps``."""

from __future__ import annotations

import math

from ftctl.config.schema import TrainConfig


def learning_rate(step: int, t: TrainConfig) -> float:
    if step < t.warmup_steps:
        return t.lr * (step + 1) / t.warmup_steps
    progress = (step - t.warmup_steps) / max(1, t.max_steps - t.warmup_steps)
    floor = t.lr * t.min_lr_ratio
    return floor + (t.lr - floor) * 0.5 * (1.0 + math.cos(math.pi * min(1.0, progress)))
