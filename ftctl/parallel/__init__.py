"""Parallel backends behind one interface (:class:`ftctl.parallel.base.Backend`).

A backend knows the process group (rank, world size, device) and wraps the model and optimizer
into an :class:`ftctl.parallel.base.Engine`, through which the runner does backward, the optimizer
step and the gathering of weights for saving. The runner never asks which backend it has.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ftctl.config.schema import RunConfig
from ftctl.errors import ConfigError

if TYPE_CHECKING:  # the package is imported by config validation, before torch is
    from ftctl.parallel.base import Backend


def create_backend(cfg: RunConfig) -> Backend:
    from ftctl.parallel.support import check_supported

    check_supported(cfg)  # again here: workers and in-process callers arrive without the CLI's check
    name = cfg.parallel.name
    if name == "single":
        from ftctl.parallel.single import SingleProcess

        return SingleProcess(cfg)
    if name == "ddp":
        from ftctl.parallel.ddp import DDPBackend

        return DDPBackend(cfg)
    if name == "fsdp":
        from ftctl.parallel.fsdp import FSDPBackend

        return FSDPBackend(cfg)
    if name in ("zero1", "zero2", "zero3"):
        from ftctl.parallel.deepspeed_zero import DeepSpeedZeroBackend

        return DeepSpeedZeroBackend(cfg)
    raise ConfigError(f"parallel={name} is not available in this build of ftctl")
