"""The run directory: refused when it holds another run, then stamped with the resolved config."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from ftctl.config.compose import load_resolved, to_yaml
from ftctl.config.schema import RunConfig
from ftctl.errors import FtctlError
from ftctl.parallel.support import DEEPSPEED_CONFIG_FILE
from ftctl.preflight import check_files
from ftctl.training.checkpoint import STATE_FILE, complete_checkpoints

CONFIG_FILE = "config.yaml"
#: What a run writes into its dir; overwrite=true deletes exactly these.
RUN_OUTPUTS = ("checkpoints", "final", "metrics.jsonl", "tensorboard", "train.log", DEEPSPEED_CONFIG_FILE, CONFIG_FILE,
               "wandb", "mlruns", "trackers.json", "loss_curve.png")


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
        raise FtctlError(
            f"output_dir {run_dir} is not empty; "
            + ("continue it with resume=auto, " if resumable else "")
            + "choose another output_dir, or pass overwrite=true to start over (its checkpoints and results are deleted)"
        )
    elif occupied:
        _delete_run_outputs(run_dir)
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / CONFIG_FILE).write_text(to_yaml(cfg))
    return run_dir


def discard_unstarted_run(run_dir: Path) -> None:
    """After a failure before the first step: remove what this run wrote, so nothing half-written stays."""
    started = (run_dir / "metrics.jsonl").is_file() and (run_dir / "metrics.jsonl").stat().st_size > 0
    if started or (run_dir / "checkpoints").exists() or (run_dir / "final").exists():
        return
    _delete_run_outputs(run_dir)
    if run_dir.is_dir() and not any(run_dir.iterdir()):
        run_dir.rmdir()


def _delete_run_outputs(run_dir: Path) -> None:
    for child in RUN_OUTPUTS:
        target = run_dir / child
        shutil.rmtree(target, ignore_errors=True) if target.is_dir() else target.unlink(missing_ok=True)


def _check_resumable(cfg: RunConfig, run_dir: Path) -> bool:
    """Whether the run continues from a checkpoint; raises when it must not start at all."""
    from ftctl.training.resume import check_resumable_by, config_differences, resume_checkpoint

    if (run_dir / "final").exists():  # a finished run: resuming would only train its tail again over its result
        raise FtctlError(
            f"output_dir {run_dir} holds a finished run (final/); nothing to resume. Choose another output_dir, "
            "or pass overwrite=true instead of resume=… to start over"
        )
    ckpt = resume_checkpoint(cfg, run_dir)
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
    metrics = run_dir / "metrics.jsonl"
    if metrics.is_file():  # drop lines of steps that will be trained again
        kept = [line for line in metrics.read_text().splitlines() if line.strip() and json.loads(line)["step"] <= step]
        metrics.write_text("".join(line + "\n" for line in kept))
    return True
