"""The optimizer named by ``train.optimizer``: torch AdamW, or a bitsandbytes 8-bit / paged AdamW.

All of them use decoupled weight decay on matrices only (biases, norms and DoRA magnitudes are not
decayed). Paged optimizers keep their state in CUDA unified memory that spills to the host under
pressure; bitsandbytes has that only on CUDA devices and elsewhere silently falls back to plain
state, so asking for one anywhere else is an error rather than a setting that does nothing.
"""

from __future__ import annotations

import torch

from ftctl.config.schema import RunConfig
from ftctl.errors import ConfigError

_BNB_OPTIMIZERS = {"adamw_8bit": "AdamW8bit", "paged_adamw_8bit": "PagedAdamW8bit", "paged_adamw_32bit": "PagedAdamW32bit"}


def _param_groups(model: torch.nn.Module, weight_decay: float) -> list:
    params = [p for p in model.parameters() if p.requires_grad]
    decay = [p for p in params if p.ndim >= 2]
    no_decay = [p for p in params if p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def build_optimizer(model: torch.nn.Module, cfg: RunConfig, device: torch.device) -> torch.optim.Optimizer:
    t = cfg.train
    groups = _param_groups(model, t.weight_decay)
    common = dict(lr=t.lr, betas=(t.adam_beta1, t.adam_beta2), eps=t.adam_eps)
    if t.optimizer == "adamw":
        on_cpu = all(p.device.type == "cpu" for g in groups for p in g["params"])
        return torch.optim.AdamW(groups, foreach=not on_cpu, **common)
    from ftctl.parallel.support import optimizer_refusal

    refusal = optimizer_refusal(t.optimizer, device.type)
    if refusal:
        raise ConfigError(refusal)
    try:
        import bitsandbytes.optim as bnb_optim
    except ImportError as exc:
        raise ConfigError(f"train.optimizer={t.optimizer} needs bitsandbytes (pip install bitsandbytes): {exc}") from None
    return getattr(bnb_optim, _BNB_OPTIMIZERS[t.optimizer])(groups, **common)
