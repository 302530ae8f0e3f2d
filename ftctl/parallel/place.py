"""Where this process sits in a job, read from its launcher's environment (no torch).

torchrun and the deepspeed launcher export RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT;
SLURM's srun exports SLURM_PROCID, SLURM_NTASKS and SLURM_LOCALID instead. Either way ftctl joins
the group in place (:mod:`ftctl.parallel.distributed`).
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Mapping, Optional


@dataclass(frozen=True)
class ProcessPlace:
    """This process's place in the job as the launcher described it."""

    rank: int
    world_size: int
    local_rank: int
    master_addr: Optional[str]
    master_port: Optional[int]
    launcher: str  # "torchrun" (also the deepspeed launcher), "slurm" or "none"


def _slurm_step(environ: Mapping[str, str]) -> bool:
    # A batch script also sees SLURM_NTASKS; only the tasks of an srun step are ranks.
    return environ.get("SLURM_STEP_ID", "").isdigit() and int(environ.get("SLURM_NTASKS", "1")) > 1


def first_slurm_host(nodelist: str) -> Optional[str]:
    """The first host of a compact SLURM node list: 'gpu[03-05,9],cpu1' -> 'gpu03'."""
    match = re.match(r"^([^,\[]+)(?:\[([^\]]+)\])?", nodelist.strip())
    if not match:
        return None
    prefix, ranges = match.group(1), match.group(2)
    if not ranges:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def process_place(environ: Mapping[str, str] = os.environ) -> ProcessPlace:
    if "RANK" in environ and "WORLD_SIZE" in environ:
        port = environ.get("MASTER_PORT")
        return ProcessPlace(
            int(environ["RANK"]), int(environ["WORLD_SIZE"]), int(environ.get("LOCAL_RANK", "0")),
            environ.get("MASTER_ADDR"), int(port) if port else None, "torchrun",
        )
    if _slurm_step(environ):
        port = environ.get("MASTER_PORT")
        addr = environ.get("MASTER_ADDR") or first_slurm_host(environ.get("SLURM_JOB_NODELIST", "") or environ.get("SLURM_NODELIST", ""))
        return ProcessPlace(
            int(environ["SLURM_PROCID"]), int(environ["SLURM_NTASKS"]), int(environ.get("SLURM_LOCALID", "0")),
            addr, int(port) if port else None, "slurm",
        )
    return ProcessPlace(0, 1, 0, None, None, "none")


def inside_launcher(environ: Mapping[str, str] = os.environ) -> bool:
    """True when a launcher (torchrun, deepspeed, srun) already started one process per rank."""
    return process_place(environ).launcher != "none"
