"""Parallel backends behind one interface (:class:`ftctl.parallel.base.Backend`).

A backend knows the process group (rank, world size, device) and wraps the model and optimizer
into an :class:`ftctl.parallel.base.Engine`, through which the runner does backward, the optimizer
step and the gathering of weights for saving. The runner never asks which backend it has.
"""

from __future__ import annotations

from ftctl.config.schema import RunConfig
from ftctl.errors import ConfigError
from ftctl.parallel.base import Backend


def create_backend(cfg: RunConfig) -> Backend:
    name = cfg.parallel.name
    if name == "single":
        from ftctl.parallel.single import SingleProcess

        return SingleProcess(cfg)
    raise ConfigError(f"parallel={name} is not available in this build of ftctl")
