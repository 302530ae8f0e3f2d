"""The backend and engine interfaces, and the torch-native engine that single, DDP and FSDP share."""

from __future__ import annotations

import contextlib
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Dict, Optional, Tuple

import torch

from ftctl.config.schema import RunConfig
from ftctl.precision.policy import PrecisionPolicy


@dataclass
class StepResult:
    grad_norm: float
    skipped: bool  # no update applied: an fp16 overflow, or non-finite gradients without a scaler


class Engine:
    """What the training loop drives: forward through ``module``, then ``backward`` and ``step``."""

    module: torch.nn.Module
    optimizer: torch.optim.Optimizer
    skipped_steps: int = 0  # steps whose update was not applied (fp16 overflow, non-finite gradients)

    def accumulating(self, last_micro_batch: bool):
        """Context for one micro-batch's forward and backward; gradient sync happens on the last."""
        return contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        raise NotImplementedError

    def forward_backward(self, batches, loss_of: Callable, scale: float, device: torch.device) -> torch.Tensor:
        """Forward and backward of this rank's micro-batches of one step, gradients accumulating.

        ``loss_of(module, batch)`` is a micro-batch's summed token loss; it is scaled by ``scale``
        for backward. Returns the summed losses, detached, in float64 on the device (not read back).
        A pipeline runs all micro-batches through its schedule instead of one at a time.
        """
        loss_sum = torch.zeros((), dtype=torch.float64, device=device)
        for i, batch in enumerate(batches):
            with self.accumulating(last_micro_batch=i == len(batches) - 1):
                micro_loss = loss_of(self.module, batch)
                self.backward(micro_loss * scale)
            loss_sum += micro_loss.detach().double()
        return loss_sum

    @torch.no_grad()
    def eval_loss_sum(self, batches, loss_of: Callable) -> torch.Tensor:
        """The summed token loss of ``batches`` without gradients, float64 on the device."""
        total = None
        for batch in batches:
            loss = loss_of(self.module, batch).double()
            total = loss if total is None else total + loss
        return total

    def step(self, max_grad_norm: float, sync: Callable[[torch.Tensor, bool], Tuple[torch.Tensor, float]]) -> StepResult:
        """Clip to ``max_grad_norm`` (when > 0) and apply the update unless the gradients are non-finite.

        ``sync(local_grad_norm, sharded)`` is the step's one reduction across ranks; the engine calls it
        once, when its gradients are final, and gets the global norm back as a device tensor and a number.
        """
        raise NotImplementedError

    def set_lr(self, lr: float) -> None:
        for group in self.optimizer.param_groups:
            group["lr"] = lr

    def gathered_state_dict(self) -> Optional[Dict[str, torch.Tensor]]:
        """The full, unsharded state dict on the main rank (None elsewhere)."""
        raise NotImplementedError

    def loss_scale(self) -> Optional[float]:
        return None

    def scaler_metrics(self) -> dict:
        """The loss scale and the number of skipped (overflow) steps, for metrics; empty without a scaler."""
        scale = self.loss_scale()
        return {} if scale is None else {"loss_scale": scale, "skipped_steps": self.skipped_steps}

    def save_training_state(self, ckpt_dir: Path, rank: int) -> None:
        """Write optimizer and scaler state into a checkpoint dir; collective, every rank calls it."""
        raise NotImplementedError

    def load_training_state(self, ckpt_dir: Path, rank: int) -> None:
        """Restore what :meth:`save_training_state` wrote (same backend and world size)."""
        raise NotImplementedError


class TorchEngine(Engine):
    """Plain torch optimisation with an optional GradScaler; DDP and FSDP wrap ``module`` differently."""

    grads_sharded = False  # every rank holds every gradient (averaged); FSDP's engine holds shards

    def __init__(self, module, optimizer, precision: PrecisionPolicy, scaler=None, no_sync: Optional[Callable] = None):
        self.module, self.optimizer, self.precision, self.scaler = module, optimizer, precision, scaler
        self._no_sync = no_sync

    def accumulating(self, last_micro_batch):
        if self._no_sync is None or last_micro_batch:
            return contextlib.nullcontext()
        return self._no_sync()

    def backward(self, loss):
        (self.scaler.scale(loss) if self.scaler else loss).backward()

    def step(self, max_grad_norm, sync):
        if self.scaler:
            self.scaler.unscale_(self.optimizer)
        grads = local_grads(self.optimizer)
        local = torch.nn.utils.get_total_norm(grads) if grads else torch.zeros(())
        norm, grad_norm = sync(local, sharded=self.grads_sharded)
        clip_local_grads(grads, norm, max_grad_norm)
        # A NaN/inf update would destroy the weights; the runner decides whether to go on. An fp16 overflow is
        # the same signal: the gradient norm is inf exactly when the scaler found an inf.
        skipped = not math.isfinite(grad_norm)
        if not skipped:
            self.optimizer.step()
        if self.scaler:
            self.scaler.update()  # lowers the scale after an overflow, from the flags unscale_ left on the device
        self.optimizer.zero_grad(set_to_none=True)
        self.skipped_steps += skipped
        return StepResult(grad_norm, skipped)

    def loss_scale(self):
        return self.scaler.get_scale() if self.scaler else None

    def gathered_state_dict(self):
        return {k: v.detach().cpu() for k, v in self.module.state_dict().items()}

    def save_training_state(self, ckpt_dir, rank):
        state = {"optimizer": self.optimizer.state_dict(), "scaler": self.scaler.state_dict() if self.scaler else None}
        torch.save(state, Path(ckpt_dir) / f"optimizer.rank{rank}.pt")

    def load_training_state(self, ckpt_dir, rank):
        state = torch.load(Path(ckpt_dir) / f"optimizer.rank{rank}.pt", weights_only=True)
        self.optimizer.load_state_dict(state["optimizer"])
        if self.scaler and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])


class Backend:
    """A process group and the way it wraps a model for training."""

    rank: int = 0
    local_rank: int = 0
    world_size: int = 1
    device: torch.device

    def __init__(self, cfg: RunConfig):
        self.cfg = cfg

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def dp_rank(self) -> int:
        """This rank's place among the ranks that each train on their own share of a batch."""
        return self.rank

    @property
    def dp_size(self) -> int:
        """Ranks that each train on their own share of a batch (tensor- and pipeline-parallel ranks share theirs)."""
        return self.world_size

    @property
    def build_device(self) -> torch.device:
        """Where the method should materialise the model before :meth:`prepare` takes it over."""
        return self.device

    def parallelize(self, model: torch.nn.Module) -> torch.nn.Module:
        """Apply train.gradient_checkpointing and train.compile; a mesh also splits the model here, in torchtitan's order."""
        apply_checkpointing(model, self.cfg)
        apply_compile(model, self.cfg, log_it=self.is_main)
        return model

    def prepare(self, model: torch.nn.Module, make_optimizer: Callable, precision: PrecisionPolicy) -> Engine:
        raise NotImplementedError

    def all_reduce_sum(self, value: torch.Tensor) -> torch.Tensor:
        return value

    def barrier(self) -> None:
        pass

    def close(self) -> None:
        pass


def default_device(local_rank: int = 0) -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", local_rank)
    return torch.device("cpu")


def local_grads(optimizer) -> list:
    """This rank's gradients: a sharded parameter's local shard (DTensors), else the whole gradient."""
    grads = [p.grad for group in optimizer.param_groups for p in group["params"] if p.grad is not None]
    return [g.to_local() if hasattr(g, "to_local") else g for g in grads]


def clip_local_grads(grads: list, norm: torch.Tensor, max_grad_norm: float) -> None:
    """Clip ``grads`` to ``max_grad_norm`` (when > 0) given their global ``norm``, as torch's clip_grad_norm_ but on the
    device: nothing is read back."""
    if max_grad_norm > 0 and grads:
        coefficient = (max_grad_norm / (norm + 1e-6)).clamp(max=1.0)
        torch._foreach_mul_(grads, coefficient.to(grads[0].device))


def apply_checkpointing(model: torch.nn.Module, cfg: RunConfig) -> None:
    if cfg.train.gradient_checkpointing:
        from ftctl.models.checkpointing import enable_activation_checkpointing

        enable_activation_checkpointing(model, every=cfg.train.gradient_checkpointing_every)


def apply_compile(model: torch.nn.Module, cfg: RunConfig, log_it: bool = True) -> None:
    if cfg.train.compile:
        from ftctl.models.compile import compile_decoder_layers

        compiled = compile_decoder_layers(model)
        if log_it:
            logging.getLogger("ftctl").info("train.compile: %d decoder layers compiled one by one", compiled)
