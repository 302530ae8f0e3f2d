"""Exact resume: which checkpoint to continue from, whether the config still allows it, and restoring it.

Everything that decides the next step is restored: weights (loaded before the backend wraps the
model, so every backend shards or broadcasts them as on a fresh start), optimizer and scaler (by
the engine), the RNG states of every rank, and the step. The data order and the learning rate are
functions of the seed and the step, so the step alone restores them.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import shutil
from dataclasses import asdict
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

from ftctl.config.schema import RunConfig
from ftctl.errors import FtctlError, refused_pickle
from ftctl.parallel.support import CHECKPOINT_STATE_DIRS
from ftctl.training.checkpoint import STATE_FILE, checkpoint_problem, checkpoints_dir, set_rng_state, step_dirs

log = logging.getLogger("ftctl")

#: Keys that may differ between a run and its resumption without changing what it computes.
RESUME_SAFE_KEYS = {
    "resume", "overwrite", "output_dir",
    "train.save_every", "train.keep_last", "train.log_every", "train.eval_every", "train.progress_bar",
    "train.tensorboard", "train.report_to", "train.plot", "train.num_threads", "train.max_nonfinite_steps",
    "train.early_stopping_patience", "train.stop_on_divergence", "train.divergence_window",
    "parallel.master_addr", "parallel.master_port", "parallel.rdzv_backend", "parallel.rdzv_id", "parallel.node_rank",
    "data.cache_dir",
}


def flatten_keys(d: dict, prefix: str = "") -> Dict[str, object]:
    out = {}
    for key, value in d.items():
        if isinstance(value, dict):
            out.update(flatten_keys(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


#: The run's length: changing it extends (or shortens) the run, and the schedule is recomputed for the new total.
RUN_LENGTH_KEYS = {"train.max_steps", "train.epochs"}


def config_differences(old: RunConfig, new: RunConfig) -> List[str]:
    """Keys whose change would make the resumed run compute something else, each as `key (run: old, now: new)`."""
    a, b = flatten_keys(asdict(old)), flatten_keys(asdict(new))
    differing = sorted(k for k in a.keys() | b.keys() if k not in RESUME_SAFE_KEYS | RUN_LENGTH_KEYS and a.get(k) != b.get(k))
    return [f"{k} (run: {_shown(a.get(k))}, now: {_shown(b.get(k))})" for k in differing]


def _shown(value) -> str:
    return "null" if value is None else str(value)


def run_length(cfg: RunConfig) -> tuple:
    return cfg.train.max_steps, cfg.train.epochs


def resume_checkpoint(cfg: RunConfig, run_dir: Path) -> Optional[Path]:
    """The checkpoint dir to continue from: the newest usable one for resume=auto, or the given path (refused
    in one line when it is not usable)."""
    if not cfg.resume:
        return None
    if cfg.resume == "auto":
        return usable_checkpoint(run_dir)[0]
    path = Path(cfg.resume).expanduser()
    problem = checkpoint_problem(path) if path.is_dir() else "no such directory"
    if problem:
        raise FtctlError(f"resume={cfg.resume}: not a usable ftctl checkpoint: {problem}; pass another checkpoint dir "
                         "(RUN/checkpoints/step-N), or resume=auto to take the run's newest usable one")
    return path


def usable_checkpoint(run_dir: Path) -> Tuple[Optional[Path], List[Tuple[Path, str]]]:
    """The newest checkpoint that passes checkpoint_problem, and the newer ones that did not, with what is wrong."""
    damaged = []
    for _, ckpt in reversed(step_dirs(run_dir)):
        problem = checkpoint_problem(ckpt)
        if problem is None:
            return ckpt, damaged
        damaged.append((ckpt, problem))
    return None, damaged


def set_aside_damaged(run_dir: Path) -> Optional[Path]:
    """resume=auto, by the process owning the run dir: damaged checkpoints newer than the newest usable one are
    renamed out of the way (never resumed or pruned, kept to look at), saves cut off are removed; returns the usable one."""
    ckpt, damaged = usable_checkpoint(run_dir)
    for path, problem in damaged:
        target, n = path.with_name(f"{path.name}.damaged"), 1
        while target.exists():
            n += 1
            target = path.with_name(f"{path.name}.damaged-{n}")
        os.replace(path, target)
        then = f"continuing from {ckpt.name}" if ckpt is not None else "no usable checkpoint is left"
        log.warning("resume=auto: %s is damaged (%s); set aside as %s, %s", path, problem, target.name, then)
    for partial in checkpoints_dir(run_dir).glob(".step-*.partial") if checkpoints_dir(run_dir).is_dir() else []:
        shutil.rmtree(partial, ignore_errors=True)  # a save that was cut off: never complete, never resumed
    return ckpt


SAME_LAYOUT = {"single", "ddp"}  # neither keeps a state dir of its own (CHECKPOINT_STATE_DIRS)


def check_resumable_by(ckpt: Path, cfg: RunConfig) -> None:
    """Refuse, before anything starts, a checkpoint that another backend or world size wrote."""
    state = json.loads((ckpt / STATE_FILE).read_text())
    parallel = cfg.parallel.name
    written_by = state.get("parallel")
    if written_by is not None:
        same = written_by == parallel or {written_by, parallel} <= SAME_LAYOUT
    else:  # a checkpoint from before the backend was recorded: tell it by its layout
        found = next((d for d in sorted(set(CHECKPOINT_STATE_DIRS.values())) if (ckpt / d).is_dir()), None)
        written_by = {None: "single or ddp", CHECKPOINT_STATE_DIRS["fsdp"]: "fsdp", CHECKPOINT_STATE_DIRS["zero1"]: "zero1/2/3",
                      CHECKPOINT_STATE_DIRS["mesh"]: "mesh"}[found]
        same = found == CHECKPOINT_STATE_DIRS.get(parallel)
    if not same:
        raise FtctlError(f"{ckpt} was written by parallel={written_by} and this run has parallel={parallel}; "
                         "resume with the backend that wrote it")
    from ftctl.launch import world_size
    from ftctl.parallel.place import process_place

    # Under torchrun, srun or the deepspeed launcher the launcher, not the config, sets the world size.
    place = process_place()
    world = place.world_size if place.launcher != "none" else world_size(cfg)
    if state.get("world_size", 1) != world:
        raise FtctlError(f"{ckpt} was written by {state['world_size']} processes and this run has {world}; "
                         "resume with the same parallel settings")


def restore_training_state(ckpt: Path, engine, backend) -> int:
    """Restore optimizer, scaler and this rank's RNG; return the step to continue from."""
    state = json.loads((ckpt / STATE_FILE).read_text())
    if state.get("world_size", 1) != backend.world_size:
        raise FtctlError(
            f"{ckpt} was written by {state['world_size']} processes and this run has {backend.world_size}; "
            "resume with the same parallel settings"
        )
    optimizer_file = ckpt / f"optimizer.rank{backend.rank}.pt"
    try:
        engine.load_training_state(ckpt, backend.rank)
    except pickle.UnpicklingError as exc:
        raise refused_pickle(optimizer_file if optimizer_file.is_file() else ckpt, exc) from None
    rng_file = ckpt / f"rng.rank{backend.rank}.pt"
    try:
        set_rng_state(torch.load(rng_file, weights_only=True))
    except pickle.UnpicklingError as exc:
        raise refused_pickle(rng_file, exc) from None
    if backend.is_main:
        log.info("resumed from %s at step %d", ckpt, state["step"])
    return int(state["step"])
