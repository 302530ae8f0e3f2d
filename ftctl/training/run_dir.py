"""The run directory: ftctl's own, written by one run at a time, and never a place where a user's files are lost.

A directory is a run only when ftctl's marker (``.ftctl-run``) says so; ftctl writes it when it
creates the run. ftctl deletes or moves only the names a run writes (:data:`RUN_OUTPUTS`) and only in
a marked directory, and refuses the file system root, the home directory, the project (the current
directory, ftctl's own checkout) and every directory above them. The process that owns the run
holds its lock (:mod:`ftctl.training.run_lock`) from before the first change until it ends.
"""

from __future__ import annotations

import json
import logging
import os
import re
import shutil
import time
from pathlib import Path
from typing import List, Optional, Tuple

from ftctl.config.compose import load_resolved, to_yaml
from ftctl.config.schema import RunConfig
from ftctl.console import close_run_log
from ftctl.errors import FtctlError
from ftctl.fs_faults import writing
from ftctl.parallel.support import DEEPSPEED_CONFIG_FILE
from ftctl.preflight import check_files
from ftctl.training import run_lock
from ftctl.training.checkpoint import STATE_FILE, complete_checkpoints

log = logging.getLogger("ftctl")

CONFIG_FILE = "config.yaml"
MARKER_FILE = ".ftctl-run"
#: What a run writes into its dir: all that overwrite=true deletes and that resume=auto moves aside.
RUN_OUTPUTS = ("checkpoints", "final", "metrics.jsonl", "tensorboard", "train.log", DEEPSPEED_CONFIG_FILE, CONFIG_FILE,
               "wandb", "mlruns", "trackers.json", "loss_curve.png", "best", ".final.partial", ".best.partial")
#: ftctl's own bookkeeping in a run dir, never a user's.
BOOKKEEPING = (MARKER_FILE, run_lock.LOCK_FILE)
_ATTEMPT = re.compile(r"^attempt-(\d+)$")


def prepare_run_dir(cfg: RunConfig) -> Path:
    """Create or reuse the run dir under the rules of a fresh start, overwrite=true or resume; take its lock.

    Everything that could refuse is checked before anything is written; the lock is taken before
    anything already there changes, and kept when this returns (``finish_run_dir`` gives it up).
    """
    check_files(cfg)
    run_dir = Path(cfg.output_dir).expanduser()
    _refuse_protected(run_dir, cfg.output_dir)
    entries = _entries(run_dir)
    marked = (run_dir / MARKER_FILE).is_file()
    if entries and not marked:
        raise FtctlError(_not_a_run(run_dir, entries, cfg))
    if cfg.resume == "auto" and not entries:
        log.info("resume=auto: no run in %s yet; starting one", run_dir)
    if entries and not cfg.resume and not cfg.overwrite:
        resumable = bool(complete_checkpoints(run_dir))
        finished = (run_dir / "final").exists()
        raise FtctlError(
            f"output_dir {run_dir} is not empty; "
            + ("extend it with resume=auto and a higher train.max_steps, " if resumable and finished else "")
            + ("continue it with resume=auto, " if resumable and not finished else "")
            + "choose another output_dir, or pass overwrite=true to start over (its checkpoints and results are deleted)"
        )
    took_lock = False
    try:
        with writing(run_dir, "the run dir"):
            if marked:  # an existing run: nobody else may change it while this one decides
                took_lock = run_lock.acquire(run_dir)
            resume_from = _check_resumable(cfg, run_dir) if cfg.resume else None  # reads only; refusals happen here
            run_dir.mkdir(parents=True, exist_ok=True)
            if not marked:
                _write_atomically(run_dir / MARKER_FILE, json.dumps({"ftctl_run": 1, "created": time.strftime("%Y-%m-%d %H:%M:%S")}) + "\n")
                took_lock = run_lock.acquire(run_dir)
            if resume_from is not None:
                _continue_from(cfg, run_dir, resume_from)
            elif cfg.resume == "auto":
                _set_aside_damaged(run_dir)
                if _entries(run_dir):
                    _move_attempt_aside(run_dir)
            elif entries:  # overwrite=true
                _delete_run_outputs(run_dir, announce=True)
            _write_atomically(run_dir / CONFIG_FILE, to_yaml(cfg))
    except BaseException:
        if took_lock:
            run_lock.release(run_dir)
        raise
    return run_dir


def finish_run_dir(run_dir: Path) -> None:
    """The run is over (finished, failed or stopped): close its train.log and give its lock up."""
    close_run_log()
    run_lock.release(run_dir)


def _entries(run_dir: Path) -> List[str]:
    """What the dir holds besides ftctl's own bookkeeping."""
    if not run_dir.is_dir():
        if run_dir.exists():
            raise FtctlError(f"output_dir {run_dir} is a file; choose a directory")
        return []
    return sorted(p.name for p in run_dir.iterdir() if p.name not in BOOKKEEPING)


def _not_a_run(run_dir: Path, entries: List[str], cfg: RunConfig) -> str:
    shown = ", ".join(entries[:5]) + (f" and {len(entries) - 5} more" if len(entries) > 5 else "")
    why = f"output_dir {run_dir} is not an ftctl run (no {MARKER_FILE} marker) and holds {shown}"
    if (run_dir / CONFIG_FILE).is_file() and (run_dir / "metrics.jsonl").is_file():  # a run of an ftctl before the marker
        why += f" (if an earlier ftctl wrote it, mark it as a run: touch {run_dir / MARKER_FILE})"
    if cfg.resume == "auto":
        return f"resume=auto: {why}, so there is nothing to resume; check output_dir, or choose a new or empty one to start a run"
    if cfg.overwrite:
        return f"overwrite=true: {why}; ftctl deletes only what its runs wrote, so choose a new or empty output_dir"
    if cfg.resume:
        return f"{why}; choose a new or empty output_dir for the run resumed from {cfg.resume}"
    return f"{why}; choose a new or empty output_dir"


def _refuse_protected(run_dir: Path, given: str) -> None:
    """The root, the home directory and the project (and anything above them) are never a run dir."""
    target = run_dir.resolve()
    places = (("the home directory", Path.home), ("the current directory", Path.cwd),
              ("ftctl's own directory", lambda: Path(__file__).parents[2]))  # its checkout (or site-packages, installed)
    for name, where in places:
        try:
            place = where().resolve()
        except (OSError, RuntimeError):  # no home, or a current directory that was deleted
            continue
        if target == place or target in place.parents:
            what = "the file system root" if target == Path(target.anchor) else (name if target == place else f"a directory above {name} ({place})")
            raise FtctlError(f"output_dir {given} is {what}; a run needs a directory of its own, e.g. output_dir=runs/NAME")


def _write_atomically(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)


def _move_attempt_aside(run_dir: Path) -> Optional[Path]:
    """resume=auto found no checkpoint to continue: keep the earlier attempt's files in attempt-N/, delete nothing."""
    outputs = [name for name in RUN_OUTPUTS if (run_dir / name).exists() or (run_dir / name).is_symlink()]
    if not outputs:
        return None
    taken = [int(m.group(1)) for m in (_ATTEMPT.match(p.name) for p in run_dir.iterdir()) if m]
    target = run_dir / f"attempt-{max(taken, default=0) + 1}"
    target.mkdir()
    for name in outputs:
        os.replace(run_dir / name, target / name)
    log.warning("resume=auto: %s holds no complete checkpoint to continue from; moved the earlier attempt's files "
                "(%s) to %s/ and starting over", run_dir, ", ".join(outputs), target.name)
    return target


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
    if run_dir.is_dir() and not _entries(run_dir):  # only the marker and the lock are left: the dir was this run's
        run_lock.release(run_dir)
        for name in BOOKKEEPING:
            (run_dir / name).unlink(missing_ok=True)
        run_dir.rmdir()
    return not run_dir.exists()


def _delete_run_outputs(run_dir: Path, announce: bool = False) -> List[str]:
    """Delete what a run wrote (and earlier attempts, with overwrite=true); files of anyone else stay."""
    attempts = sorted(p.name for p in run_dir.iterdir() if _ATTEMPT.match(p.name)) if announce else []
    removed = []
    for child in (*RUN_OUTPUTS, *attempts):
        target = run_dir / child
        if not (target.exists() or target.is_symlink()):
            continue
        folder = target.is_dir() and not target.is_symlink()
        shutil.rmtree(target) if folder else target.unlink()
        removed.append(child + ("/" if folder else ""))
    if announce:
        left = _entries(run_dir)
        log.warning("overwrite=true: removed %s from %s%s", ", ".join(removed) or "nothing", run_dir,
                    f"; left what ftctl did not write: {', '.join(left)}" if left else "")
    return removed


def _check_resumable(cfg: RunConfig, run_dir: Path) -> Optional[Path]:
    """The checkpoint the run continues from (None: resume=auto starts over); raises when it must not start at all.

    Reads only: nothing in the run dir changes before every check has passed.
    """
    from ftctl.training.resume import check_resumable_by, config_differences, resume_checkpoint

    ckpt = resume_checkpoint(cfg, run_dir)
    finished = (run_dir / "final").exists()
    if finished:
        _check_extendable(cfg, run_dir, ckpt)
    if ckpt is None:  # resume=auto with no checkpoint: a fresh start, as a preemptible job expects
        return None
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
    _kept_metrics(run_dir / "metrics.jsonl", step)  # a damaged line refuses here, before anything changes
    return ckpt


def _set_aside_damaged(run_dir: Path) -> None:
    from ftctl.training.resume import set_aside_damaged

    set_aside_damaged(run_dir)


def _continue_from(cfg: RunConfig, run_dir: Path, ckpt: Path) -> None:
    """The changes a resume makes once it is allowed: the metrics of steps to train again go, damaged checkpoints are
    set aside, and a finished run being extended loses its final/ (written again at the new end)."""
    from ftctl.training.resume import run_length

    step = json.loads((ckpt / STATE_FILE).read_text())["step"]
    _trim_metrics(run_dir / "metrics.jsonl", step)
    if cfg.resume == "auto":
        _set_aside_damaged(run_dir)
    if (run_dir / "final").exists():  # its weights are the checkpoint's
        shutil.rmtree(run_dir / "final")
        log.info("extending the finished run %s from step %d (%s)", run_dir, step,
                 ", ".join(f"{k}={v}" for k, v in zip(("train.max_steps", "train.epochs"), run_length(cfg)) if v is not None))


def _kept_metrics(path: Path, step: int) -> Optional[Tuple[bytes, Optional[int]]]:
    """metrics.jsonl without the lines of steps to train again and a last line cut off when the run was killed
    (None when there is no file), with the count of its lines when that last line was dropped; a damaged line
    elsewhere refuses, naming it."""
    if not path.is_file():
        return None
    lines = [(number, raw) for number, raw in enumerate(path.read_bytes().split(b"\n"), start=1) if raw.strip()]
    kept, cut_off = [], None
    for number, raw in lines:
        try:
            record = json.loads(raw)
        except ValueError:
            if number == lines[-1][0]:
                cut_off = len(lines)
                continue
            raise FtctlError(f"{path}:{number}: not a JSON line (edited or damaged); remove that line, then resume again") from None
        if record.get("step", 0) <= step:
            kept.append(raw + b"\n")
    return b"".join(kept), cut_off


def _trim_metrics(path: Path, step: int) -> None:
    trimmed = _kept_metrics(path, step)
    if trimmed is None:
        return
    kept, cut_off = trimmed
    if cut_off is not None:
        log.warning("%s: dropped its last line (line %d), cut off when the run stopped", path, cut_off)
    _write_atomically(path, kept.decode("utf-8", errors="replace"))


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
            "exactly (runs keep a checkpoint of their last step; this one's is gone). Start a new run instead"
        )


def end_failed_run(run_dir: Path, reason: BaseException) -> None:
    """train.log says why the run stopped; a run that never took a step leaves nothing behind."""
    close_run_log(ending=reason)
    if discard_unstarted_run(run_dir) and was_announced(run_dir):
        log.info("removed run dir %s: the run stopped before its first step", run_dir)
