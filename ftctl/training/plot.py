"""The loss curve of a run dir (``loss_curve.png``), drawn from its metrics.jsonl when matplotlib is installed.

A preference run (objective=dpo, simpo, orpo, kto) gets a second panel under the loss: the reward
margin (chosen − rejected) and the reward accuracy, train per step and eval as points.

`ftctl train` draws it when a run ends and `ftctl plot RUN_DIR` redraws it. pyplot is never
imported: a figure drawn through the Agg canvas leaves the process's backend alone.
"""

from __future__ import annotations

import importlib.util
import logging
import math
from pathlib import Path
from typing import Optional

from ftctl.errors import FtctlError
from ftctl.paths import make_parent

log = logging.getLogger("ftctl")

PLOT_FILE = "loss_curve.png"


def can_plot() -> bool:
    return importlib.util.find_spec("matplotlib") is not None


def _title(run_dir: Path) -> str:
    """'<method> on <model>' ('<objective> with <method> on <model>') from the run's config.yaml, else the run dir's name."""
    import yaml

    try:
        cfg = yaml.safe_load((run_dir / "config.yaml").read_text())
        objective = (cfg.get("objective") or {}).get("name", "sft")
        what = cfg["method"]["name"] if objective == "sft" else f"{objective} with {cfg['method']['name']}"
        return f"{what} on {Path(str(cfg['model']['name_or_path'])).name}"
    except (OSError, KeyError, TypeError, yaml.YAMLError):
        return run_dir.name


def draw_loss_curve(run_dir, output=None, title: Optional[str] = None) -> Path:
    """Train loss per logged step and the eval losses as points, on a log scale; returns the file written."""
    from ftctl.training.metrics import read_metrics

    run_dir = Path(run_dir)
    fig = loss_figure(read_metrics(run_dir), title or _title(run_dir), run_dir)
    out = Path(output).expanduser() if output else run_dir / PLOT_FILE
    formats = fig.canvas.get_supported_filetypes()
    if out.suffix.lower().lstrip(".") not in formats:
        raise FtctlError(f"output={out}: matplotlib writes {', '.join('.' + f for f in sorted(formats))}; name the image with one of them")
    fig.savefig(make_parent(out, "output"))
    return out


def _series(rows, key):
    return [(r["step"], r[key]) for r in rows if math.isfinite(r.get(key, math.nan))]


def loss_figure(rows, title: str, run_dir: Path = Path(".")):
    """The figure of :func:`draw_loss_curve`: the loss panel, and the reward panel when the rows have rewards."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    train = _series(rows, "loss")
    # eval_loss, then each named eval set's eval/<name>_loss, as its own series of points
    eval_keys = list(dict.fromkeys(k for r in rows for k in r if k == "eval_loss" or (k.startswith("eval/") and k.endswith("_loss"))))
    series = {key: _series(rows, key) for key in eval_keys}
    evals = [point for points in series.values() for point in points]
    if not train and not evals:
        raise FtctlError(f"{run_dir}: no metrics.jsonl with losses to plot; pass the output_dir of a run that took a step")
    margins, eval_margins = _series(rows, "rewards/margins"), _series(rows, "eval_rewards/margins")
    preference = bool(margins or eval_margins)
    fig = Figure(figsize=(6, 6.0 if preference else 3.6), dpi=120)
    FigureCanvasAgg(fig)
    ax = fig.add_subplot(2, 1, 1) if preference else fig.add_subplot()
    if train:
        ax.plot(*zip(*train), label="train loss", color="tab:blue")
    for key, points in series.items():
        if points:
            label = "held-out loss" if key == "eval_loss" else f"{key[len('eval/'):-len('_loss')]} loss"
            ax.plot(*zip(*points), "o", label=label, **({"color": "tab:orange"} if key == "eval_loss" else {}))
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("preference loss per example" if preference else "cross-entropy per trained token")
    losses = [loss for _, loss in train + evals]
    if min(losses) > 0 and max(losses) / min(losses) >= 10:  # a loss falling by orders of magnitude reads best on a log scale
        ax.set_yscale("log")
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend()
    if preference:
        _reward_panel(fig.add_subplot(2, 1, 2, sharex=ax), rows, margins, eval_margins)
    fig.tight_layout()
    return fig


def _reward_panel(ax, rows, margins, eval_margins) -> None:
    """Reward margin on the left axis, reward accuracy (0-1) on the right."""
    if margins:
        ax.plot(*zip(*margins), label="train reward margin", color="tab:green")
    if eval_margins:
        ax.plot(*zip(*eval_margins), "o", label="held-out reward margin", color="tab:olive")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("reward margin (chosen − rejected)")
    ax.grid(alpha=0.3)
    accuracy = ax.twinx()
    for key, style, colour, label in (("rewards/accuracies", "-", "tab:red", "train reward accuracy"),
                                      ("eval_rewards/accuracies", "s", "tab:purple", "held-out reward accuracy")):
        points = _series(rows, key)
        if points:
            accuracy.plot(*zip(*points), style, color=colour, label=label, alpha=0.8)
    accuracy.set_ylim(-0.02, 1.02)
    accuracy.set_ylabel("reward accuracy")
    lines = ax.get_legend_handles_labels()
    more = accuracy.get_legend_handles_labels()
    ax.legend(lines[0] + more[0], lines[1] + more[1], fontsize="small", loc="best")


def plot_after_run(run_dir: Path) -> Optional[Path]:
    """The end-of-run plot: skipped without matplotlib; a failure to draw is a warning, never a failed run."""
    if not can_plot() or not (run_dir / "metrics.jsonl").is_file():
        return None
    try:
        return draw_loss_curve(run_dir)
    except FtctlError:  # stopped before its first metrics line: nothing to draw
        return None
    except Exception as exc:  # noqa: BLE001 - the run's results are saved; a plot must not turn it into a failure
        from ftctl.fs_faults import fault_errno

        # A full or lost disk is the run's own error, said once; the plot's failure would only repeat it.
        (log.debug if fault_errno(exc) is not None else log.warning)("could not draw %s: %s", run_dir / PLOT_FILE, exc)
        return None
