"""Process groups: where this process sits (from a launcher's environment) and the shared data-parallel plumbing.

torchrun and the deepspeed launcher export RANK, WORLD_SIZE, LOCAL_RANK, MASTER_ADDR and MASTER_PORT;
SLURM's srun exports SLURM_PROCID, SLURM_NTASKS and SLURM_LOCALID instead. Either way ftctl joins
the group in place; without a launcher a multi-process run is started by :mod:`ftctl.launch`.
"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Mapping, Optional

from ftctl.errors import ConfigError
from ftctl.parallel.base import Backend, default_device


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


def collective_backend(requested: str, device_type: str) -> str:
    if requested == "auto":
        return "nccl" if device_type == "cuda" else "gloo"
    if requested == "nccl" and device_type != "cuda":
        raise ConfigError("parallel.dist_backend=nccl needs CUDA GPUs; on CPU use gloo (or auto)")
    return requested


def ensure_process_group(requested_backend: str, master_port_fallback: int = 29500) -> bool:
    """Join the job's process group unless one exists; returns True when this call created it (and owns it)."""
    import torch
    import torch.distributed as dist

    if dist.is_initialized():
        return False
    place = process_place()
    device_type = "cuda" if torch.cuda.is_available() else "cpu"
    backend = collective_backend(requested_backend, device_type)
    if device_type == "cuda":
        torch.cuda.set_device(place.local_rank)
    if place.launcher == "none":
        # One process asked for a data-parallel backend: a group of one, no network needed.
        # (DeepSpeed insists on LOCAL_RANK; RANK and WORLD_SIZE stay unset, they mean "under a launcher".)
        os.environ.setdefault("LOCAL_RANK", "0")
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
        return True
    os.environ.setdefault("MASTER_ADDR", place.master_addr or "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(place.master_port or master_port_fallback))
    os.environ.setdefault("RANK", str(place.rank))
    os.environ.setdefault("WORLD_SIZE", str(place.world_size))
    os.environ.setdefault("LOCAL_RANK", str(place.local_rank))
    dist.init_process_group(backend, init_method="env://", rank=place.rank, world_size=place.world_size)
    return True


class DataParallelBackend(Backend):
    """A process group of data-parallel ranks: what DDP, FSDP and ZeRO have in common."""

    def __init__(self, cfg):
        import torch.distributed as dist

        super().__init__(cfg)
        self._owns_group = ensure_process_group(cfg.parallel.dist_backend, cfg.parallel.master_port)
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.local_rank = process_place().local_rank
        self.device = default_device(self.local_rank)
        t = cfg.train
        if t.global_batch_size % (t.micro_batch_size * self.world_size):
            self.close()
            raise ConfigError(
                f"train.global_batch_size={t.global_batch_size} must be a multiple of train.micro_batch_size × "
                f"world size = {t.micro_batch_size} × {self.world_size} (the launcher started {self.world_size} ranks)"
            )

    def all_reduce_sum(self, value):
        import torch.distributed as dist

        # nccl reduces only device tensors; the runner keeps its counters on the CPU.
        on_device = value.to(self.device, copy=True)
        dist.all_reduce(on_device, op=dist.ReduceOp.SUM)
        return on_device.to(value.device)

    def barrier(self):
        import torch.distributed as dist

        if self.device.type == "cuda":
            dist.barrier(device_ids=[self.device.index])
        else:
            dist.barrier()

    def close(self):
        import torch.distributed as dist

        if self._owns_group and dist.is_initialized():
            dist.destroy_process_group()
        self._owns_group = False
