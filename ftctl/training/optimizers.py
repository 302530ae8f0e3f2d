"""The optimizer named by ``train.optimizer``, and the one interface the runner drives every optimizer through.

- ``adamw``: torch's AdamW. ``adamw_8bit``, ``paged_adamw_8bit``, ``paged_adamw_32bit``: bitsandbytes'.
- ``adafactor``: torch's Adafactor (factored second moments of matrices, steps relative to each
  tensor's RMS, capped by the lr).
- ``lion``, ``lion_8bit``: bitsandbytes' Lion (sign of an interpolated momentum; one state, in fp32
  or 8-bit blocks).
- ``sgd``: torch's SGD, with ``train.sgd_momentum`` and ``train.sgd_nesterov``.
- ``schedule_free_adamw``: the ``schedulefree`` package's AdamW. It trains at one point of its
  iterates (y) and evaluates at their average (x), so evaluation, checkpoints and the final result
  need its weights switched: :func:`evaluation_weights` does that for any optimizer that has such a
  switch, and nothing for the others, so the runner never asks which optimizer it drives.

Weight decay applies to matrices only (biases, norms and DoRA magnitudes are not decayed). Paged
optimizers keep their state in CUDA unified memory that spills to the host under pressure;
bitsandbytes has that only on CUDA devices and elsewhere silently falls back to plain state, so
asking for one anywhere else is an error rather than a setting that does nothing.
"""

from __future__ import annotations

import contextlib

import torch

from ftctl.config.schema import RunConfig
from ftctl.errors import ConfigError

_BNB_OPTIMIZERS = {
    "adamw_8bit": "AdamW8bit", "paged_adamw_8bit": "PagedAdamW8bit", "paged_adamw_32bit": "PagedAdamW32bit",
    "lion": "Lion", "lion_8bit": "Lion8bit",
}


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list:
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_optimizer(model: torch.nn.Module, cfg: RunConfig, device: torch.device) -> torch.optim.Optimizer:
    t = cfg.train
    groups = _param_groups(model, t.weight_decay)
    # torch's foreach kernels pay off on GPUs; on CPUs the per-tensor loop is as fast and allocates less.
    foreach = not all(p.device.type == "cpu" for g in groups for p in g["params"])
    betas = (t.adam_beta1, t.adam_beta2)
    if t.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=t.lr, betas=betas, eps=t.adam_eps, foreach=foreach)
    if t.optimizer == "adafactor":
        return torch.optim.Adafactor(groups, lr=t.lr, foreach=foreach)
    if t.optimizer == "sgd":
        return torch.optim.SGD(groups, lr=t.lr, momentum=t.sgd_momentum, nesterov=t.sgd_nesterov, foreach=foreach)
    from ftctl.parallel.support import optimizer_refusal

    refusal = optimizer_refusal(t.optimizer, device.type)
    if refusal:
        raise ConfigError(refusal)
    if t.optimizer == "schedule_free_adamw":
        return ScheduleFreeAdamW(groups, lr=t.lr, betas=betas, eps=t.adam_eps, foreach=foreach)
    import bitsandbytes.optim as bnb_optim

    optimizer_class = getattr(bnb_optim, _BNB_OPTIMIZERS[t.optimizer])
    _check_bitsandbytes_runs(optimizer_class, t.optimizer, device)
    extra = {} if t.optimizer.startswith("lion") else {"eps": t.adam_eps}
    return optimizer_class(groups, lr=t.lr, betas=betas, **extra)


def _check_bitsandbytes_runs(optimizer_class, name: str, device: torch.device) -> None:
    """One step on a throwaway tensor: whether this bitsandbytes build has the kernel for ``device``.

    The tensor is as large as bitsandbytes' threshold for 8-bit state, so an 8-bit optimizer takes its 8-bit path.
    """
    probe = torch.zeros(4096, device=device, requires_grad=True)
    probe.grad = torch.ones_like(probe)
    try:
        optimizer_class([probe], lr=0.0).step()
    except (NotImplementedError, RuntimeError) as exc:
        first_line = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ConfigError(f"train.optimizer={name}: bitsandbytes has no {optimizer_class.__name__} for {device.type} "
                          f"here ({first_line}); use train.optimizer=adamw") from None


# ---------------------------------------------------------------------------------------- weights


def evaluation_weights(optimizer) -> contextlib.AbstractContextManager:
    """For the block: the weights to evaluate and save, then exactly the training weights again.

    Schedule-free AdamW's averaged weights; the trained weights themselves for every other optimizer.
    """
    switch = getattr(optimizer, "evaluation_weights", None)
    return switch() if switch is not None else contextlib.nullcontext()


def settle_final_weights(optimizer) -> None:
    """Leave the model holding the weights the run's result is: schedule-free's average; a no-op elsewhere."""
    settle = getattr(optimizer, "settle_final_weights", None)
    if settle is not None:
        settle()


def _schedule_free_base():
    try:
        from schedulefree import AdamWScheduleFree
    except ImportError:  # a message, not an import error, when the package is missing (optimizer_refusal)
        return torch.optim.Optimizer
    return AdamWScheduleFree


class ScheduleFreeAdamW(_schedule_free_base()):
    """schedulefree's AdamW with its train/eval switch behind :func:`evaluation_weights`, made exact.

    Its own ``eval()`` and ``train()`` move each weight between y (trained) and x (averaged) by
    interpolating with z, which does not round-trip exactly in floating point. So entering
    :meth:`evaluation_weights` keeps a copy of y and leaving it copies y back: a run that evaluates or
    checkpoints trains exactly as one that does not. The state dict carries y next to z (key ``"y"``),
    so a checkpoint holds x as its loadable weights and y in the optimizer state, and
    :meth:`load_state_dict` puts y back into the weights: a resumed run continues exactly. The
    state dict always has y (a copy of the weights outside the block), so a backend that builds a
    template of the state to load into (FSDP's distributed checkpoint) asks for it too.
    """

    def __init__(self, params, **kwargs):
        super().__init__(params, warmup_steps=0, **kwargs)  # ftctl's schedule warms up through the lr
        # Training mode from the start. No z exists yet, so only the flag changes; set directly, as
        # train() would leave an empty state per parameter, which reads as "already initialised".
        for group in self.param_groups:
            group["train_mode"] = True
        self._train_weights = None  # y, while the weights are x

    def _averaged_params(self):
        return [p for group in self.param_groups for p in group["params"] if "z" in self.state.get(p, ())]

    @contextlib.contextmanager
    def evaluation_weights(self):
        with torch.no_grad():
            self._train_weights = {p: p.detach().clone() for p in self._averaged_params()}
            self.eval()
        try:
            yield
        finally:
            self._put_back(self._train_weights)
            self._train_weights = None

    def settle_final_weights(self) -> None:
        self.eval()

    @torch.no_grad()
    def _put_back(self, train_weights: dict) -> None:
        for p, y in train_weights.items():
            p.copy_(y)
        for group in self.param_groups:
            group["train_mode"] = True

    def state_dict(self):
        packed = super().state_dict()
        index = 0  # torch numbers the parameters across the groups in order
        for group in self.param_groups:
            for p in group["params"]:
                if index in packed["state"] and "z" in self.state.get(p, ()):
                    y = self._train_weights[p] if self._train_weights is not None else p.detach().clone()
                    packed["state"][index] = {**packed["state"][index], "y": y}
                index += 1
        return packed

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)
        self._put_back({p: self.state[p].pop("y") for p in self._averaged_params() if "y" in self.state[p]})
