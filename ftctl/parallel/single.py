"""One process on one device."""

from __future__ import annotations

from ftctl.parallel.base import Backend, TorchEngine, default_device


class SingleProcess(Backend):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.device = default_device()

    def prepare(self, model, make_optimizer, precision):
        return TorchEngine(model, make_optimizer(model), precision, precision.make_scaler())
