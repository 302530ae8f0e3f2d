"""The run's length and learning-rate schedule: linear warmup, then cosine, linear, cosine with restarts,
warmup-stable-decay (WSD) or no decay.

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


def wsd_decay_steps(t: TrainConfig, total: int) -> int:
    """WSD's final decay: ``ceil(wsd_decay_ratio × total)`` steps, at most the steps after warmup."""
    return min(math.ceil(t.wsd_decay_ratio * total), max(0, total - warmup_steps(t, total)))


def _cosine(progress: float) -> float:
    return 0.5 * (1.0 + math.cos(math.pi * progress))


#: Decay shapes from 1 (progress 0) to 0 (progress 1).
WSD_SHAPES = {"linear": lambda p: 1.0 - p, "cosine": _cosine, "1-sqrt": lambda p: 1.0 - math.sqrt(p)}


def learning_rate(step: int, t: TrainConfig, total: int) -> float:
    """The lr of 0-based ``step`` in a run of ``total`` steps: warmup reaches lr at its last step; linear and
    cosine decay from lr at the first step after warmup to ``min_lr_ratio × lr`` at the last step."""
    warmup = warmup_steps(t, total)
    if step < warmup:
        return t.lr * (step + 1) / warmup
    if t.lr_scheduler == "constant":
        return t.lr
    floor = t.lr * t.min_lr_ratio
    if t.lr_scheduler == "wsd":
        decay = wsd_decay_steps(t, total)
        start = total - decay
        if step < start:
            return t.lr
        # The decay's first step is already below lr, its last at the floor.
        shape = WSD_SHAPES[t.wsd_decay_shape](min(1.0, (step + 1 - start) / decay))
        return floor + (t.lr - floor) * shape
    span = max(1, total - warmup)
    # Linear and cosine reach the floor at the last step, step total - 1 (one step after warmup: it takes lr).
    progress = min(1.0, (step - warmup) / max(1, total - 1 - warmup))
    if t.lr_scheduler == "linear":
        shape = 1.0 - progress
    elif t.lr_scheduler == "cosine_restarts":
        # Each of lr_cycles cycles is a cosine from lr down to the floor at its last step (as cosine's one
        # cycle), then a jump back to lr; in integers, so a cycle's first step is exactly at lr.
        shape = _cosine(min(1.0, (step - warmup) * t.lr_cycles % span / max(1, span - t.lr_cycles)))
    else:
        shape = _cosine(progress)
    return floor + (t.lr - floor) * shape
