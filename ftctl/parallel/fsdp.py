"""FSDP2 through torch's ``fully_shard``: one sharding unit per decoder layer plus the root.

Each parameter becomes a DTensor holding 1/N of its rows on each rank; a unit's full weights exist
only while that layer runs. Gradients are reduce-scattered (averaged, like DDP), so each rank's
optimizer updates only its own shard. accelerate's FSDP plugin is not used: on CPU it silently
trains plain DDP.
"""

from __future__ import annotations

import contextlib
import warnings
from pathlib import Path
from typing import List

import torch

from ftctl.errors import FtctlError
from ftctl.parallel.base import TorchEngine
from ftctl.parallel.distributed import DataParallelBackend
from ftctl.parallel.support import CHECKPOINT_STATE_DIRS

STATE_DIR = CHECKPOINT_STATE_DIRS["fsdp"]  # torch.distributed.checkpoint shards of trainable weights and optimizer state
SCALER_FILE = "scaler.pt"


def decoder_layers(model: torch.nn.Module) -> List[torch.nn.Module]:
    """The repeated blocks to shard one by one: the classes transformers never splits across devices."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    block_names = set(getattr(base, "_no_split_modules", None) or ())
    layers = [m for m in model.modules() if type(m).__name__ in block_names]
    if not layers:
        lists = [m for m in model.modules() if isinstance(m, torch.nn.ModuleList)]
        layers = list(max(lists, key=len)) if lists else []
    if not layers:
        raise FtctlError(f"parallel=fsdp: found no repeated decoder layers to shard in {type(base).__name__}")
    return layers


class FSDPEngine(TorchEngine):
    grads_sharded = True

    def __init__(self, module, optimizer, precision, scaler, is_main: bool):
        super().__init__(module, optimizer, precision, scaler)
        self.is_main = is_main

    def accumulating(self, last_micro_batch):
        # FSDP2's no_sync: gradients stay local and unsharded until the step's last micro-batch.
        self.module.set_requires_gradient_sync(last_micro_batch)
        return contextlib.nullcontext()

    def gathered_state_dict(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        # Collective: every rank sends its shards; only rank 0 receives the full tensors (on the CPU).
        state = get_model_state_dict(self.module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        return state if self.is_main else None

    def _sharded_state(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        # Frozen base weights are the pretrained ones; a checkpoint needs only what trains.
        model_state, optim_state = get_state_dict(self.module, self.optimizer, options=StateDictOptions(ignore_frozen_params=True))
        return {"model": model_state, "optimizer": optim_state}

    def save_training_state(self, ckpt_dir, rank):
        import torch.distributed.checkpoint as dcp

        dcp.save(self._sharded_state(), checkpoint_id=str(Path(ckpt_dir) / STATE_DIR))
        if self.scaler is not None and self.is_main:
            torch.save(self.scaler.state_dict(), Path(ckpt_dir) / SCALER_FILE)

    def load_training_state(self, ckpt_dir, rank):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        state = self._sharded_state()
        dcp.load(state, checkpoint_id=str(Path(ckpt_dir) / STATE_DIR))
        set_state_dict(
            self.module, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"],
            options=StateDictOptions(ignore_frozen_params=True, strict=False),
        )
        if self.scaler is not None:
            self.scaler.load_state_dict(torch.load(Path(ckpt_dir) / SCALER_FILE, weights_only=True))


class FSDPBackend(DataParallelBackend):
    @property
    def build_device(self):
        # fully_shard moves each unit to the GPU and shards it there, one decoder layer at a time, so the
        # whole model never sits on one GPU. QLoRA stays on the device: bitsandbytes quantises where it places.
        if self.device.type == "cuda" and self.cfg.method.name != "qlora":
            return torch.device("cpu")
        return self.device

    def prepare(self, model, make_optimizer, precision):
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

        p = self.cfg.parallel
        mesh = init_device_mesh(self.device.type, (self.world_size,))
        offload = CPUOffloadPolicy(pin_memory=self.device.type == "cuda") if p.offload_params == "cpu" else OffloadPolicy()
        for layer in decoder_layers(model):
            fully_shard(layer, mesh=mesh, reshard_after_forward=p.reshard_after_forward, offload_policy=offload)
        # The root unit holds embeddings, final norm and head; backward needs them at once, so keep them gathered.
        fully_shard(model, mesh=mesh, reshard_after_forward=False, offload_policy=offload)
        if precision.needs_scaler:
            # ShardedGradScaler keeps its found-inf flag as a 1-element tensor, which DTensor warns about every step.
            warnings.filterwarnings("ignore", message="Found a non-scalar tensor with numel=1", category=UserWarning)
        # The optimizer is built over the sharded DTensor parameters, so its states are sharded too.
        return FSDPEngine(model, make_optimizer(model), precision, precision.make_scaler(sharded=True), self.is_main)
