"""Evals during training: the eval sets a run scores, the best checkpoint it keeps, and early stopping.

A run scores, with the runner's ``evaluate``, ``eval_loss`` on data.eval_path / eval_fraction and
``eval/<name>_loss`` on each named set of data.eval_sets (and ``eval/<name>_perplexity`` where the set
lists perplexity), every ``train.eval_every`` steps and at the end. :class:`BestSoFar` compares ``train.best_metric`` (lower is
better): with ``train.keep_best`` every better value writes the weights to ``<output_dir>/best/`` (a
result dir like final/, plus ``best.json``), and ``train.early_stopping_patience`` evals in a row
without a better value stop the run. Its record travels in every checkpoint's trainer_state.json, so
a resumed or extended run compares against the best of the whole run.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
from pathlib import Path
from typing import Callable, Dict, Optional, Tuple

from ftctl.config.eval_sets import DEFAULT_EVAL_KEY, metric_names, named_eval_sets, set_metric_key
from ftctl.training.checkpoint import STATE_FILE

log = logging.getLogger("ftctl")

BEST_DIR = "best"
BEST_FILE = "best.json"
_STATE_KEY = "best_so_far"  # in trainer_state.json


class RunEvals:
    """The eval sets of one run: the default split (``eval_loss``) and the named ones, and when they run."""

    def __init__(self, eval_data, named: Dict[str, object], data_cfg, eval_every: int):
        self.sets = ([(DEFAULT_EVAL_KEY, eval_data)] if eval_data is not None else []) + [
            (set_metric_key(name, "loss"), data) for name, data in named.items()]
        self.perplexity = {set_metric_key(name, "loss"): set_metric_key(name, "perplexity")
                           for name, entry in named_eval_sets(data_cfg.eval_sets).items() if "perplexity" in metric_names(entry.metric)}
        self.eval_every = eval_every
        self.named_sizes = {name: len(data) for name, data in named.items()}

    def __bool__(self) -> bool:
        return bool(self.sets)

    def due(self, done: int, steps: int) -> bool:
        return bool(self.sets) and ((self.eval_every and done % self.eval_every == 0) or done == steps)

    def run(self, evaluate: Callable[[object], Tuple[float, Dict[str, float]]]) -> Dict[str, float]:
        """Every set's mean loss and the perplexities asked for, then the objective's metrics of every set
        (``evaluate(dataset)``, the runner's: (loss, metrics), the same on every rank); the first value is the first set's loss."""
        values, extra = {}, {}
        for key, data in self.sets:
            values[key], metrics = evaluate(data)
            if key in self.perplexity:
                values[self.perplexity[key]] = math.exp(min(values[key], 700.0))  # exp(700) is still a float
            prefix = key[: -len("loss")]  # eval_loss -> eval_rewards/margins, eval/<name>_loss -> eval/<name>_rewards/margins
            extra.update({prefix + name: value for name, value in metrics.items()})
        return {**values, **extra}


def write_weights(directory: Path, *, backend, engine, method, model, tokenizer, info: dict) -> None:
    """Write the current weights as a result dir (what final/ holds) plus ``best.json``; complete or absent.

    Every rank calls this: gathering a sharded model's state is collective.
    """
    state = engine.gathered_state_dict()
    if backend.is_main:
        staging = directory.with_name(f".{directory.name}.partial")
        shutil.rmtree(staging, ignore_errors=True)
        method.save(model, tokenizer, staging, state_dict=method.trainable_state_dict(model, state))
        (staging / BEST_FILE).write_text(json.dumps(info, indent=2) + "\n")
        shutil.rmtree(directory, ignore_errors=True)
        os.replace(staging, directory)
    backend.barrier()


class BestSoFar:
    """train.best_metric's best value, its step, and the evals since it improved: keep_best and early stopping."""

    def __init__(self, train_cfg, run_dir: Path, is_main: bool):
        self.metric = train_cfg.best_metric
        self.keep_best = train_cfg.keep_best
        self.patience = train_cfg.early_stopping_patience
        self.threshold = train_cfg.early_stopping_threshold
        self.best_dir = Path(run_dir) / BEST_DIR
        self.is_main = is_main
        self.value: Optional[float] = None
        self.step: Optional[int] = None
        self.evals_without_improvement = 0
        self.stopped_at: Optional[int] = None

    @property
    def active(self) -> bool:
        return self.keep_best or self.patience > 0

    def state(self) -> dict:
        """What a checkpoint records of it (trainer_state.json)."""
        if not self.active:
            return {}
        return {_STATE_KEY: {"metric": self.metric, "value": self.value, "step": self.step,
                             "evals_without_improvement": self.evals_without_improvement}}

    def restore(self, checkpoint: Optional[Path]) -> None:
        """Continue the record a checkpoint kept; a run resumed from before its first eval starts without one."""
        if checkpoint is None or not self.active:
            return
        saved = json.loads((Path(checkpoint) / STATE_FILE).read_text()).get(_STATE_KEY)
        if not saved or saved.get("metric") != self.metric:
            return
        self.value, self.step = saved["value"], saved["step"]
        self.evals_without_improvement = int(saved["evals_without_improvement"])
        if self.is_main and self.value is not None:
            log.info("best %s so far: %.6g at step %d (%d evals since)", self.metric, self.value, self.step, self.evals_without_improvement)

    def observe(self, step: int, values: Dict[str, float]) -> bool:
        """Take one eval's values into the record; returns whether the run stops early at this step."""
        if not self.active:
            return False
        value = values[self.metric]
        if math.isfinite(value) and (self.value is None or value < self.value - self.threshold):
            self.value, self.step, self.evals_without_improvement = value, step, 0
            return False
        self.evals_without_improvement += 1
        if self.patience and self.evals_without_improvement >= self.patience:
            self.stopped_at = step
        return self.stopped_at == step

    def act(self, step: int, save_best: Callable[[Path, dict], None]) -> None:
        """After the eval of ``step`` is logged: keep its weights if it was the best so far, say why the run stops."""
        if self.keep_best and self.step == step:
            save_best(self.best_dir, {"step": step, "metric": self.metric, "value": self.value})
            if self.is_main:
                log.info("step %d: best %s so far, %.6g; weights in %s", step, self.metric, self.value, self.best_dir)
        if self.stopped_at == step and self.is_main:
            since = f"{self.value:.6g} at step {self.step}" if self.value is not None else "no finite value yet"
            log.info("early stopping at step %d: %s has not improved on %s for %d evals (train.early_stopping_patience=%d)",
                     step, self.metric, since, self.evals_without_improvement, self.patience)

    def summary(self) -> Optional[str]:
        if not self.keep_best or self.step is None:
            return None
        return f"best {self.metric} {self.value:.6g} at step {self.step} -> {self.best_dir}"
