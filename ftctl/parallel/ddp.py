"""DDP: every rank holds the whole model and optimizer; gradients are averaged over ranks in backward."""

from __future__ import annotations

from ftctl.parallel.base import TorchEngine
from ftctl.parallel.distributed import DataParallelBackend


class DDPEngine(TorchEngine):
    def __init__(self, ddp_module, optimizer, precision, scaler, is_main: bool):
        super().__init__(ddp_module, optimizer, precision, scaler, no_sync=ddp_module.no_sync)
        self.is_main = is_main

    def gathered_state_dict(self):
        # Every rank holds the same weights; only the main rank needs a copy, without DDP's "module." prefix.
        if not self.is_main:
            return None
        return {k: v.detach().cpu() for k, v in self.module.module.state_dict().items()}


class DDPBackend(DataParallelBackend):
    def prepare(self, model, make_optimizer, precision):
        from torch.nn.parallel import DistributedDataParallel

        ddp = DistributedDataParallel(model, device_ids=[self.device.index] if self.device.type == "cuda" else None)
        return DDPEngine(ddp, make_optimizer(model), precision, precision.make_scaler(), self.is_main)
