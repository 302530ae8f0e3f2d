"""The one factory of parallel backends: the config's ``parallel.name`` to its :class:`ftctl.parallel.base.Backend`."""

from __future__ import annotations

from typing import TYPE_CHECKING

from ftctl.config.schema import RunConfig
from ftctl.errors import ConfigError

if TYPE_CHECKING:  # this module stays torch-free until a backend is created
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
    if name == "mesh":
        from ftctl.parallel.mesh import MeshBackend

        return MeshBackend(cfg)
    if name in ("zero1", "zero2", "zero3"):
        from ftctl.parallel.deepspeed_zero import DeepSpeedZeroBackend

        return DeepSpeedZeroBackend(cfg)
    raise ConfigError(f"parallel={name} is not available in this build of ftctl")
