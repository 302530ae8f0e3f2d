"""Checkpoints under <output_dir>/checkpoints/step-<N>/, written to a temporary dir and renamed when complete.

A checkpoint is itself a loadable result (a peft adapter dir or a transformers model dir) plus the
optimizer, scaler and RNG state needed to continue. ``trainer_state.json`` is written last, so a
dir without it is incomplete and is never chosen for resume. It lists every file of the checkpoint
with its size, so that a file lost or cut short later (a disk fault, a copy that stopped) is found
before a resume loads it: :func:`checkpoint_problem` checks the list, the safetensors headers and
the torch files' zip directories.

A fault of the machine while writing (full disk, file-size limit, read-only or lost mount) removes
the partial checkpoint and stops the run with one line; earlier checkpoints are never touched
before a new one is complete.
"""

from __future__ import annotations

import errno
import json
import os
import random
import re
import shutil
import zipfile
from pathlib import Path
from typing import Callable, List, Optional, Tuple

import numpy as np
import torch

from ftctl.fs_faults import FilesystemFault, fault_message, free_bytes, writing

STATE_FILE = "trainer_state.json"
FILES_KEY = "files"  # in STATE_FILE: every other file of the checkpoint with its size in bytes
_STEP_DIR = re.compile(r"^step-(\d+)$")
#: What a checkpoint holds besides the result itself (the optimizer, scaler and RNG states of every backend).
TRAINING_STATE = ("optimizer.", "rng.", "scaler", "fsdp_state", "mesh_state", "deepspeed")


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
    run_dir: Path, step: int, *, backend, engine, method, model, tokenizer, extra: dict, keep_last: int = 0,
    protect_before: Optional[int] = None,
) -> Optional[Path]:
    """Every rank calls this (gathering is collective); the main rank writes the shared files.

    ``protect_before``: pruning keeps the newest checkpoint older than this step (the last good one
    while a divergence is being watched).
    """
    final = checkpoints_dir(run_dir) / f"step-{step}"
    staging = final.with_name(f".step-{step}.partial")
    state = engine.gathered_state_dict()
    previous = checkpoint_bytes(latest_checkpoint_files(run_dir))
    _check_space(final, f"checkpoint step-{step}", previous)  # every rank: they decide alike and none waits at a barrier
    needed = previous or (_estimate_bytes(method.trainable_state_dict(model, state)) if backend.is_main else None)
    with writing(staging, f"checkpoint step-{step}", needed, (lambda: _remove_partial(staging)) if backend.is_main else None, shown=final):
        if backend.is_main:
            shutil.rmtree(staging, ignore_errors=True)
            staging.mkdir(parents=True)
            method.save(model, tokenizer, staging, state_dict=method.trainable_state_dict(model, state))
        backend.barrier()
        engine.save_training_state(staging, backend.rank)
        torch.save(rng_state(), staging / f"rng.rank{backend.rank}.pt")
        backend.barrier()
        if backend.is_main:
            files = {str(p.relative_to(staging)): p.stat().st_size for p in sorted(staging.rglob("*")) if p.is_file()}
            state_text = json.dumps({"step": step, "world_size": backend.world_size, **extra, FILES_KEY: files}, indent=2)
            (staging / STATE_FILE).write_text(state_text)
            shutil.rmtree(final, ignore_errors=True)
            os.replace(staging, final)
            prune_checkpoints(run_dir, keep_last, protect_before)  # only now that the new checkpoint is complete
    backend.barrier()
    return final


def _estimate_bytes(trainable: dict) -> int:
    """A first checkpoint's size, for the message when it does not fit: the weights and Adam's two moments."""
    return 3 * sum(t.numel() * t.element_size() for t in trainable.values() if hasattr(t, "numel"))


def _remove_partial(staging: Path) -> None:
    """A save cut short leaves nothing: its staging dir goes, and the checkpoints dir when it holds nothing else."""
    shutil.rmtree(staging, ignore_errors=True)
    try:
        staging.parent.rmdir()
    except OSError:
        pass  # it holds earlier checkpoints


def save_result(final_dir: Path, write: Callable[[Path], None]) -> Path:
    """Write a run's result dir (``write(dir)``) next to it first and rename it into place when complete."""
    final_dir = Path(final_dir)
    staging = final_dir.with_name(f".{final_dir.name}.partial")
    weights = {name: size for name, size in latest_checkpoint_files(final_dir.parent).items() if not name.startswith(TRAINING_STATE)}
    with writing(staging, f"the result {final_dir.name}/", checkpoint_bytes(weights), lambda: shutil.rmtree(staging, ignore_errors=True),
                 shown=final_dir):
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir(parents=True)
        write(staging)
        shutil.rmtree(final_dir, ignore_errors=True)
        os.replace(staging, final_dir)
    return final_dir


def _check_space(target: Path, what: str, needed: Optional[int]) -> None:
    """Refuse before writing when the file system has less room than the last checkpoint took."""
    free = free_bytes(target)
    if needed and free is not None and free < needed:
        raise FilesystemFault(fault_message(errno.ENOSPC, target, what, needed))


def latest_checkpoint_files(run_dir: Path) -> dict:
    """The newest complete checkpoint's file list (relative path -> bytes), {} when there is none to go by."""
    for ckpt in reversed(complete_checkpoints(run_dir)):
        try:
            files = json.loads((ckpt / STATE_FILE).read_text()).get(FILES_KEY)
        except (OSError, ValueError, AttributeError):
            continue
        if isinstance(files, dict):
            return files
    return {}


def checkpoint_bytes(files: dict) -> Optional[int]:
    return sum(files.values()) if files else None


def complete_checkpoints(run_dir: Path) -> list:
    """Checkpoint dirs whose state file was written (the last step of a save), oldest first; see checkpoint_problem."""
    return [path for _, path in step_dirs(run_dir) if (path / STATE_FILE).is_file()]


def step_dirs(run_dir: Path) -> List[Tuple[int, Path]]:
    root = checkpoints_dir(run_dir)
    found = []
    for child in root.iterdir() if root.is_dir() else []:
        match = _STEP_DIR.match(child.name)
        if match and child.is_dir():
            found.append((int(match.group(1)), child))
    return sorted(found)


def prune_checkpoints(run_dir: Path, keep_last: int, protect_before: Optional[int] = None) -> None:
    if keep_last <= 0:
        return
    kept = complete_checkpoints(run_dir)
    protected = None
    if protect_before is not None:
        older = [p for p in kept if checkpoint_step(p) < protect_before]
        protected = older[-1] if older else None
    for old in kept[:-keep_last]:
        if old != protected:
            shutil.rmtree(old, ignore_errors=True)


def checkpoint_step(ckpt: Path) -> int:
    return int(_STEP_DIR.match(Path(ckpt).name).group(1))


def checkpoint_problem(ckpt: Path) -> Optional[str]:
    """What makes ``ckpt`` unusable for a resume, in a few words; None when it is complete.

    Checks what can be checked without loading it: the state file parses, every file it lists is
    there with its size, the safetensors headers describe their files exactly, and the torch files'
    zip directories are whole. Checkpoints from before the file list are checked for their RNG files.
    """
    ckpt = Path(ckpt)
    try:
        state = json.loads((ckpt / STATE_FILE).read_text())
    except FileNotFoundError:
        return f"{STATE_FILE} is missing"
    except (OSError, ValueError) as exc:
        return f"{STATE_FILE} does not parse ({str(exc).splitlines()[0][:80]})"
    if not isinstance(state, dict) or not isinstance(state.get("step"), int):
        return f"{STATE_FILE} names no step"
    files = state.get(FILES_KEY)
    if not isinstance(files, dict):  # written before ftctl listed the files
        files = {f"rng.rank{r}.pt": None for r in range(int(state.get("world_size", 1)))}
    for name, size in files.items():
        path = ckpt / name
        if not path.is_file():
            return f"{name} is missing"
        if size is not None and path.stat().st_size != size:
            return f"{name} is {path.stat().st_size} bytes, written as {size}"
    for path in sorted(ckpt.rglob("*")):
        problem = None
        if path.suffix == ".safetensors":
            problem = safetensors_problem(path)
        elif path.suffix == ".pt" and path.is_file() and not zipfile.is_zipfile(path):
            problem = "is not a whole torch file (its zip directory is missing)"
        if problem:
            return f"{path.relative_to(ckpt)} {problem}"
    return None


def safetensors_problem(path: Path) -> Optional[str]:
    """Whether a safetensors file's header parses and describes exactly the bytes the file holds."""
    size = path.stat().st_size
    with open(path, "rb") as f:
        head = f.read(8)
        if len(head) < 8:
            return "is cut short (no header)"
        length = int.from_bytes(head, "little")
        if length > size - 8:
            return f"has a header length ({length}) beyond the file's {size} bytes"
        try:
            header = json.loads(f.read(length))
            end = max((entry["data_offsets"][1] for key, entry in header.items() if key != "__metadata__"), default=0)
        except (ValueError, KeyError, TypeError, IndexError, AttributeError):
            return "has a damaged header"
    if 8 + length + end != size:
        return f"holds {size} bytes where its header describes {8 + length + end}"
    return None
