"""The run directory: refused when it holds another run, then stamped with the resolved config."""

from __future__ import annotations

import json
import logging
import shutil
from pathlib import Path

from ftctl.config.compose import load_resolved, to_yaml
from ftctl.config.schema import RunConfig
from ftctl.console import close_run_log
from ftctl.errors import FtctlError
from ftctl.parallel.support import DEEPSPEED_CONFIG_FILE
from ftctl.preflight import check_files
from ftctl.training.checkpoint import STATE_FILE, complete_checkpoints

log = logging.getLogger("ftctl")

CONFIG_FILE = "config.yaml"
#: What a run writes into its dir; overwrite=true deletes exactly these.
RUN_OUTPUTS = ("checkpoints", "final", "metrics.jsonl", "tensorboard", "train.log", DEEPSPEED_CONFIG_FILE, CONFIG_FILE,
               "wandb", "mlruns", "trackers.json", "loss_curve.png", "best")


def prepare_run_dir(cfg: RunConfig) -> Path:
    """Create or reuse the run dir under the rules of a fresh start, overwrite=true or resume."""
    check_files(cfg)
    run_dir = Path(cfg.output_dir).expanduser()
    occupied = run_dir.exists() and any(run_dir.iterdir())
    if cfg.resume:
        continuing = _check_resumable(cfg, run_dir)
        if occupied and not continuing:
            # resume=auto found no checkpoint: what is there is a run stopped before its first one.
            _delete_run_outputs(run_dir)
    elif occupied and not cfg.overwrite:
        resumable = bool(complete_checkpoints(run_dir))
        finished = (run_dir / "final").exists()
        raise FtctlError(
            f"output_dir {run_dir} is not empty; "
            + ("extend it with resume=auto and a higher train.max_steps, " if resumable and finished else "")
            + ("continue it with resume=auto, " if resumable and not finished else "")
            + "choose another output_dir, or pass overwrite=true to start over (its checkpoints and results are deleted)"
        )
    elif occupied:
        _delete_run_outputs(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / CONFIG_FILE).write_text(to_yaml(cfg))
    return run_dir


_announced = set()


def announce_run_dir(run_dir: Path) -> None:
    """Name the run dir once the run is about to take its first step, not before it could still be removed."""
    _announced.add(Path(run_dir).resolve())
    log.info("run dir %s (resolved config in config.yaml)", run_dir)


def was_announced(run_dir: Path) -> bool:
    return Path(run_dir).resolve() in _announced


def discard_unstarted_run(run_dir: Path) -> bool:
    """After a failure before the first step: remove what this run wrote, so nothing half-written stays.

    Returns whether the run dir itself is gone.
    """
    started = (run_dir / "metrics.jsonl").is_file() and (run_dir / "metrics.jsonl").stat().st_size > 0
    if started or (run_dir / "checkpoints").exists() or (run_dir / "final").exists():
        return False
    _delete_run_outputs(run_dir)
    if run_dir.is_dir() and not any(run_dir.iterdir()):
        run_dir.rmdir()
    return not run_dir.exists()


def _delete_run_outputs(run_dir: Path) -> None:
    for child in RUN_OUTPUTS:
        target = run_dir / child
        shutil.rmtree(target, ignore_errors=True) if target.is_dir() else target.unlink(missing_ok=True)


def _check_resumable(cfg: RunConfig, run_dir: Path) -> bool:
    """Whether the run continues from a checkpoint; raises when it must not start at all."""
    from ftctl.training.resume import check_resumable_by, config_differences, resume_checkpoint, run_length

    ckpt = resume_checkpoint(cfg, run_dir)
    finished = (run_dir / "final").exists()
    if finished:
        _check_extendable(cfg, run_dir, ckpt)
    if ckpt is None:  # resume=auto with no checkpoint: a fresh start, as a preemptible job expects
        return False
    check_resumable_by(ckpt, cfg)
    source = ckpt.parent.parent / CONFIG_FILE
    if source.is_file():
        differing = config_differences(load_resolved(source), cfg)
        if differing:
            raise FtctlError(
                f"cannot resume from {ckpt}: the config differs in {', '.join(differing)}; "
                "resume with the original values, or start a new run"
            )
    step = json.loads((ckpt / STATE_FILE).read_text())["step"]
    if cfg.train.max_steps is not None and step >= cfg.train.max_steps:
        raise FtctlError(f"{ckpt} is at step {step}, so train.max_steps={cfg.train.max_steps} leaves nothing to train; "
                         f"raise train.max_steps above {step} to extend the run")
    if finished:  # its weights are the checkpoint's; the extended run writes final/ again at its new end
        shutil.rmtree(run_dir / "final")
        log.info("extending the finished run %s from step %d (%s)", run_dir, step,
                 ", ".join(f"{k}={v}" for k, v in zip(("train.max_steps", "train.epochs"), run_length(cfg)) if v is not None))
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():  # drop lines of steps that will be trained again
        kept = [line for line in metrics.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
        metrics.write_text("".join(line + "\n" for line in kept))
    return True


def _check_extendable(cfg: RunConfig, run_dir: Path, ckpt) -> None:
    """A finished run continues only to a new length, and only from a checkpoint of its last step."""
    from ftctl.training.metrics import read_metrics
    from ftctl.training.resume import run_length

    saved = run_dir / CONFIG_FILE
    last_step = max((m["step"] for m in read_metrics(run_dir) if "loss" in m), default=0)
    not_longer = cfg.train.max_steps is not None and cfg.train.max_steps <= last_step
    if not saved.is_file() or run_length(load_resolved(saved)) == run_length(cfg) or not_longer:
        raise FtctlError(
            f"output_dir {run_dir} holds a finished run (final/); nothing to resume. To train it further, raise "
            f"train.max_steps above {last_step} (or train.epochs) with resume=auto; to start over, pass overwrite=true instead of resume=…"
        )
    ckpt_step = json.loads((ckpt / STATE_FILE).read_text())["step"] if ckpt is not None else None
    if ckpt_step != last_step:
        kept = f"its latest checkpoint is step {ckpt_step}" if ckpt is not None else "it kept no checkpoint"
        raise FtctlError(
            f"output_dir {run_dir} holds a finished run of {last_step} steps, but {kept}, so it cannot be extended "
            "exactly; runs trained with train.save_every>0 keep a checkpoint of their last step. Start a new run instead"
        )


def end_failed_run(run_dir: Path, reason: BaseException) -> None:
    """train.log says why the run stopped; a run that never took a step leaves nothing behind."""
    close_run_log(ending=reason)
    if discard_unstarted_run(run_dir) and was_announced(run_dir):
        log.info("removed run dir %s: the run stopped before its first step", run_dir)
