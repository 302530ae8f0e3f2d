"""Checkpoints under <output_dir>/checkpoints/step-<N>/, written to a temporary dir and renamed when complete.

A checkpoint is itself a loadable result (a peft adapter dir or a transformers model dir) plus the
optimizer, scaler and RNG state needed to continue. ``trainer_state.json`` is written last, so a
dir without it is incomplete and is never chosen for resume.
"""

from __future__ import annotations

import json
import os
import random
import re
import shutil
from pathlib import Path
from typing import Optional

import numpy as np
import torch

STATE_FILE = "trainer_state.json"
_STEP_DIR = re.compile(r"^step-(\d+)$")


def checkpoints_dir(run_dir: Path) -> Path:
    return Path(run_dir) / "checkpoints"


def rng_state() -> dict:
    np_state = np.random.get_state()
    return {
        "python": random.getstate(),
        "numpy": (np_state[0], torch.from_numpy(np_state[1].astype(np.int64)), *np_state[2:]),
        "torch": torch.get_rng_state(),
        "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else [],
    }


def set_rng_state(state: dict) -> None:
    random.setstate(tuple(state["python"][:1]) + (tuple(state["python"][1]),) + tuple(state["python"][2:]))
    kind, keys, *rest = state["numpy"]
    np.random.set_state((kind, keys.numpy().astype(np.uint32), *rest))
    torch.set_rng_state(state["torch"])
    if state["cuda"] and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def save_checkpoint(
    run_dir: Path, step: int, *, backend, engine, method, model, tokenizer, extra: dict, keep_last: int = 0
) -> Optional[Path]:
    """Every rank calls this (gathering is collective); the main rank writes the shared files."""
    final = checkpoints_dir(run_dir) / f"step-{step}"
    staging = final.with_name(f".step-{step}.partial")
    state = engine.gathered_state_dict()
    if backend.is_main:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        method.save(model, tokenizer, staging, state_dict=method.trainable_state_dict(model, state))
    backend.barrier()
    engine.save_training_state(staging, backend.rank)
    torch.save(rng_state(), staging / f"rng.rank{backend.rank}.pt")
    backend.barrier()
    if backend.is_main:
        (staging / STATE_FILE).write_text(json.dumps({"step": step, "world_size": backend.world_size, **extra}, indent=2))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(staging, final)
        prune_checkpoints(run_dir, keep_last)  # only now that the new checkpoint is complete
    backend.barrier()
    return final


def complete_checkpoints(run_dir: Path) -> list:
    """Complete checkpoints, oldest first."""
    root = checkpoints_dir(run_dir)
    found = []
    for child in root.iterdir() if root.is_dir() else []:
        match = _STEP_DIR.match(child.name)
        if match and (child / STATE_FILE).is_file():
            found.append((int(match.group(1)), child))
    return [path for _, path in sorted(found)]


def prune_checkpoints(run_dir: Path, keep_last: int) -> None:
    if keep_last > 0:
        for old in complete_checkpoints(run_dir)[:-keep_last]:
            shutil.rmtree(old, ignore_errors=True)
