"""Metrics to <output_dir>/metrics.jsonl, the trackers of train.report_to and a progress bar; only the main rank writes."""

from __future__ import annotations

import json
import logging
import math
import time
from pathlib import Path
from typing import Optional, Sequence

from ftctl.fs_faults import writing
from ftctl.progress import progress_bar as progress_bar_for
from ftctl.progress import progress_enabled
from ftctl.training.trackers import numeric_values, open_trackers

log = logging.getLogger("ftctl")


class MetricsLogger:
    def __init__(self, run_dir: Path, total_steps: int, start_step: int, *, enabled: bool, trackers: Sequence[str] = (),
                 params: Optional[dict] = None, progress_bar: bool):
        self.enabled = enabled
        self._path = run_dir / "metrics.jsonl"
        self._file = open(self._path, "ab", buffering=0) if enabled else None
        self._trackers = open_trackers(list(trackers), run_dir, params or {}) if enabled else []
        self._bar = None
        if enabled and progress_bar and progress_enabled():
            self._bar = progress_bar_for(total_steps, "train", unit="step", initial=start_step)

    def log(self, step: int, metrics: dict) -> None:
        if not self.enabled:
            return
        record = {"step": step, **{k: _plain(v) for k, v in metrics.items()}}
        self._append((json.dumps(record) + "\n").encode())
        values = numeric_values(record)
        for tracker in self._trackers:
            tracker.log(step, values)
        if self._bar is not None and "loss" in record:
            memory = record.get("mem_peak_alloc_gib", record.get("mem_peak_rss_gib"))
            extra = {"mem": f"{memory:.1f}G"} if isinstance(memory, (int, float)) else {}
            self._bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{record.get('tokens_per_s', 0):.0f}", **extra, refresh=False)
        scores = [f"{k} {v:.4f}" for k, v in record.items() if k.startswith("eval") and isinstance(v, float)]
        if scores:
            log.info("step %d: %s", step, ", ".join(scores))

    def _append(self, line: bytes) -> None:
        """One whole line or none: a write the disk cuts short is taken back, so the file never ends mid-line."""
        start = self._file.seek(0, 2)

        def take_back():
            self._file.truncate(start)

        with writing(self._path, "metrics.jsonl", len(line), take_back):
            view = memoryview(line)
            while view:
                view = view[self._file.write(view):]

    def advance(self) -> None:
        if self._bar is not None:
            self._bar.update(1)

    def write_line(self, text: str) -> None:
        if self._bar is not None:
            self._bar.write(text)
        elif self.enabled:
            log.info(text)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
        for tracker in self._trackers:
            tracker.close()
        if self._file is not None:
            self._file.close()


class LogWindow:
    """The steps since the last metrics line: their loss and token counts (summed over ranks), as the
    line reports them: the window's mean loss (per trained token; preference objectives: per example),
    rates and waste shares, and the objective's metrics (``step_metrics`` of their summed tallies)."""

    def __init__(self, device=None, step_metrics=None):
        self.device, self.step_metrics = device, step_metrics
        self._reset()

    def _reset(self):
        self.real = self.trained = self.positions = 0  # host numbers: the step's one reduction summed them
        self.loss_sum = self.loss_units = 0.0  # finite step losses weighted by their units (SFT: trained tokens)
        self.objective_sums = None
        self.start = time.perf_counter()

    def add(self, outcome) -> None:
        """One step's :class:`ftctl.training.interrupts.StepOutcome` (its counts already summed over ranks)."""
        self.real += outcome.real_tokens
        self.trained += outcome.global_tokens
        self.positions += outcome.positions
        if math.isfinite(outcome.loss):  # a skipped non-finite step is reported on its own; it must not void the window's mean
            self.loss_sum += outcome.loss * outcome.loss_units
            self.loss_units += outcome.loss_units
            if outcome.objective_sums:
                sums = self.objective_sums or [0.0] * len(outcome.objective_sums)
                self.objective_sums = [a + b for a, b in zip(sums, outcome.objective_sums)]

    def take(self) -> dict:
        elapsed = max(time.perf_counter() - self.start, 1e-9)
        real, trained, positions = self.real, self.trained, self.positions
        out = {
            "loss": self.loss_sum / self.loss_units if self.loss_units else float("nan"),
            "tokens_per_s": real / elapsed,
            "trained_tokens_per_s": trained / elapsed,
            # Shares of the computed positions: padding, and everything without a trained label.
            "padding_waste": 1.0 - real / positions,
            "non_trained_share": 1.0 - trained / positions,
            "trained_tokens": int(trained),
            **memory_peaks(self.device),
            **(self.step_metrics(self.objective_sums) if self.step_metrics and self.objective_sums else {}),
        }
        self._reset()
        return out


def memory_peaks(device) -> dict:
    """Peak memory since the last call, in GiB: allocated and reserved on a GPU (then reset), the process's RSS on a CPU.

    The allocator's reserve is what the device must actually hold; the RSS is the process's peak
    since it started (the kernel keeps no resettable peak).
    """
    import resource

    import torch

    if device is not None and torch.device(device).type == "cuda":
        out = {"mem_peak_alloc_gib": torch.cuda.max_memory_allocated(device) / 2**30,
               "mem_peak_reserved_gib": torch.cuda.max_memory_reserved(device) / 2**30}
        torch.cuda.reset_peak_memory_stats(device)
        return out
    return {"mem_peak_rss_gib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20}


def _plain(value):
    if hasattr(value, "item"):
        value = value.item()
    if isinstance(value, float):
        return round(value, 8)
    return value


def read_metrics(run_dir: Path) -> list:
    """The metrics lines of a run; a last line cut off by a kill is left out (a resume drops it from the file)."""
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return []
    lines = [line for line in path.read_text(errors="replace").splitlines() if line.strip()]
    records = []
    for number, line in enumerate(lines, start=1):
        try:
            records.append(json.loads(line))
        except ValueError:
            if number < len(lines):
                raise
    return records


def final_loss(run_dir: Path) -> Optional[float]:
    losses = [m["loss"] for m in read_metrics(run_dir) if "loss" in m]
    return losses[-1] if losses else None
