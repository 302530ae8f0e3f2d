"""Process groups: joining the job's group and the shared data-parallel plumbing.

Where this process sits in the job comes from the launcher's environment (:mod:`ftctl.parallel.place`);
without a launcher a multi-process run is started by :mod:`ftctl.launch`.
"""

from __future__ import annotations

import os

from ftctl.errors import ConfigError
from ftctl.parallel.base import Backend, default_device
from ftctl.parallel.place import process_place


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
        from ftctl.parallel.mesh_shape import data_parallel_size

        data_ranks = data_parallel_size(cfg, self.world_size)
        if t.global_batch_size % (t.micro_batch_size * data_ranks):
            self.close()
            ranks = "world size" if data_ranks == self.world_size else "data-parallel ranks"
            raise ConfigError(
                f"train.global_batch_size={t.global_batch_size} must be a multiple of train.micro_batch_size × "
                f"{ranks} = {t.micro_batch_size} × {data_ranks} (the launcher started {self.world_size} ranks)"
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
