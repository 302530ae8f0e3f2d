"""Which kernels a model's norms, MLPs, rotary embedding and loss run on: ftctl's own or liger-kernel's (``train.kernels``).

``ftctl``: the one-node RMSNorm (:mod:`ftctl.models.fast_rms_norm`) and the chunked head loss
(:mod:`ftctl.training.loss`), on any device.

``liger`` (CUDA, liger-kernel installed): liger's own apply function for the model's family, taken
from liger's table by ``model_type`` and called with the switches its signature offers (``rope``,
``rms_norm``, ``swiglu``; a family without one of them keeps its own module), so what runs is what
liger knows about the family, not a list kept here. The loss uses liger's fused linear
cross-entropy, called by ftctl's loss inside the output head's own call on the trained positions
only, instead of liger's replacement of the model's forward: that forward reads the head's weight
outside the head's call, where DeepSpeed ZeRO-3 has not gathered it, and scores every position.
"""

from __future__ import annotations

import inspect
import logging
from typing import Callable, Optional

import torch

from ftctl.errors import FtctlError
from ftctl.models.fast_rms_norm import use_fast_rms_norm

log = logging.getLogger("ftctl")

#: The attribute of an output head that holds the function computing its summed token loss, when it is not ftctl's.
HEAD_LOSS_KERNEL = "_ftctl_head_loss_kernel"
#: The switches of liger's apply functions ftctl turns on; its own loss switches stay off (see the module docstring).
LIGER_SWITCHES = {"rope": True, "rms_norm": True, "swiglu": True, "cross_entropy": False, "fused_linear_cross_entropy": False}


def use_kernels(model: torch.nn.Module, kernels: str) -> Optional[str]:
    """Put ``model`` on the ``train.kernels`` choice; returns a line for the log (None for ftctl's own)."""
    if kernels == "liger":
        return use_liger_kernels(model)
    use_fast_rms_norm(model)
    return None


def head_loss_kernel(head: torch.nn.Module) -> Optional[Callable]:
    """``f(hidden, weight, bias, targets) -> summed loss`` set for ``head``, or None for ftctl's chunked loss."""
    return head.__dict__.get(HEAD_LOSS_KERNEL)


def liger_linear_cross_entropy_sum(hidden, weight, bias, targets) -> torch.Tensor:
    from liger_kernel.transformers.functional import liger_fused_linear_cross_entropy

    return liger_fused_linear_cross_entropy(hidden, weight, targets, bias, reduction="sum")


def use_liger_kernels(model: torch.nn.Module) -> str:
    from liger_kernel.transformers.monkey_patch import MODEL_TYPE_TO_APPLY_LIGER_FN

    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # liger patches the transformers model
    model_type = getattr(getattr(base, "config", None), "model_type", None)
    apply = MODEL_TYPE_TO_APPLY_LIGER_FN.get(model_type)
    if apply is None:
        raise FtctlError(f"train.kernels=liger: the installed liger-kernel has no kernels for model_type={model_type}; "
                         f"use train.kernels=ftctl")
    offered = inspect.signature(apply).parameters
    switches = {name: on for name, on in LIGER_SWITCHES.items() if name in offered}
    apply(model=base, **switches)
    head = base.get_output_embeddings()
    if head is not None:
        head.__dict__[HEAD_LOSS_KERNEL] = liger_linear_cross_entropy_sum
    replaced = sorted({m._get_name() for m in base.modules() if m._get_name().startswith("Liger")})
    applied = [name for name, on in switches.items() if on]
    return (f"liger kernels on {model_type}: {', '.join(applied)} ({', '.join(replaced) or 'no modules replaced'}); "
            f"liger's fused linear cross-entropy wherever the head's output is the logits")
