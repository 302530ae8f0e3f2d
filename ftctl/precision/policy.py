"""Numeric precision of a run: the autocast context, the loss scaler and where `auto` resolves on a device.

Trainable parameters and optimizer states always stay fp32 (master weights); only the compute
runs in bf16 or fp16, and only frozen base weights may be stored in the compute dtype.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch

from ftctl.config.schema import PrecisionConfig
from ftctl.precision.auto import auto_precision

_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def resolve_precision_name(name: str, device: torch.device) -> str:
    if name != "auto":
        return name
    cuda_bf16 = device.type == "cuda" and torch.cuda.is_bf16_supported()
    return auto_precision(device.type, cuda_bf16)


@dataclass
class PrecisionPolicy:
    name: str  # resolved: fp32, bf16 or fp16
    device_type: str
    init_scale: float = 65536.0
    growth_interval: int = 2000

    @property
    def compute_dtype(self) -> torch.dtype:
        return _DTYPES[self.name]

    @property
    def needs_scaler(self) -> bool:
        return self.name == "fp16"

    def autocast(self):
        if self.name == "fp32":
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=self.compute_dtype)

    def frozen_weight_dtype(self) -> torch.dtype:
        """Frozen base weights may live in the compute dtype; trainable ones never do."""
        return self.compute_dtype

    def make_scaler(self, sharded: bool = False):
        if not self.needs_scaler:
            return None
        if sharded:
            from torch.distributed.fsdp.sharded_grad_scaler import ShardedGradScaler

            return ShardedGradScaler(self.device_type, init_scale=self.init_scale, growth_interval=self.growth_interval)
        return torch.amp.GradScaler(self.device_type, init_scale=self.init_scale, growth_interval=self.growth_interval)


def resolve_precision(cfg: PrecisionConfig, device: torch.device) -> PrecisionPolicy:
    return PrecisionPolicy(resolve_precision_name(cfg.name, device), device.type, cfg.init_scale, cfg.growth_interval)
