"""Tensor and expert parallelism by the model's own plans, with peft's tensor-parallel LoRA rule.

The plans are transformers' (``base_model_tp_plan``, ``base_model_ep_plan`` and the class plans,
resolved by the model itself) and so are the styles that apply them (``ColwiseParallel``,
``RowwiseParallel``, the expert dispatch): each splits a parameter into a DTensor shard on the
``tp`` (or ``ep``) axis of the run's mesh and converts the module's inputs and outputs at its
boundary. Nothing here defines a parallel layer.

Adapters are created on the whole, unsharded model (the same random initialisation as one
process), and sharded here with their base layer by peft's rule: a column-split target shards
``lora_B`` (and DoRA's magnitude) by output rows, a row-split target shards ``lora_A`` by input
columns, the other factor stays whole on every rank. Wrapping after sharding, as peft does when a
model is loaded tensor-parallel, fails two ways, which is why the order is reversed:

* peft sizes each adapter from the *local* shard of its base weight. For a row-split target
  (o_proj, down_proj) ``lora_A.in_features`` is then the local width, while transformers'
  ``RowwiseParallel`` reads ``in_features`` as the global width when it wraps the local input as a
  DTensor: "shape '[32, 16]' is invalid for input of size 1024". Every adapter is also initialised
  with a local shape, from different random numbers than one process would draw.
* a model sharded 2-D at load time (``DistributedConfig(tp_size, fsdp_size)``) is FSDP-wrapped
  before the adapters exist: peft sizes them from the FSDP shard (a quarter of the rows on a 2 × 2
  mesh) while the forward sees the TP shard (half), and the new adapter parameters are not
  FSDP-managed at all.
"""

from __future__ import annotations

import types
from typing import Dict, Optional

import torch

from ftctl.errors import FtctlError

#: Set on every module this file sharded, with its style: the loss reads it (a vocabulary-split head
#: cannot compute the loss from its local weight) and tests read it.
TP_STYLE_ATTR = "_ftctl_tp_style"


def _base_model(model: torch.nn.Module):
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    prefix = next(name for name, module in model.named_modules() if module is base)
    return base, f"{prefix}." if prefix else ""


def _is_owned(module: torch.nn.Module) -> bool:
    """False for the parts a pipeline rank does not hold (left on the meta device)."""
    return not any(p.is_meta for p in module.parameters(recurse=False))


def model_plans(model: torch.nn.Module, tp_size: int, ep_size: int = 1):
    """The model's own TP and EP plans, one entry per concrete module or parameter, in ``model``'s names."""
    from transformers.distributed import DistributedConfig

    base, prefix = _base_model(model)
    dp = ep_size // tp_size if ep_size > 1 else 1  # any size that passes transformers' check ep | dp × tp
    try:
        tp_plan, ep_plan, _ = base._resolve_parallel_plans(DistributedConfig(tp_size=tp_size, ep_size=ep_size, fsdp_size=dp))
    except ValueError as exc:
        raise FtctlError(f"{type(base).__name__}: {str(exc).splitlines()[0]}") from None
    return ({prefix + k: v for k, v in tp_plan.items()}, {prefix + k: v for k, v in ep_plan.items()})


def apply_tensor_parallel(model: torch.nn.Module, tp_mesh) -> Dict[str, str]:
    """Shard ``model`` (peft-wrapped or not) over ``tp_mesh`` by its own plan; returns the plan applied."""
    from peft.tuners.lora.layer import LoraLayer
    from transformers.distributed.tensor_parallel import apply_tensor_parallelism

    plan, _ = model_plans(model, tp_mesh.size())
    modules = dict(model.named_modules())
    parameters = dict(model.named_parameters())  # a tied head's weight is the embeddings' one: listed once
    applied: Dict[str, str] = {}
    for name, style in plan.items():
        if name not in modules and name not in parameters:
            continue  # the second name of a tied weight: split once, under its first name
        owner = modules[name] if name in modules else modules[name.rpartition(".")[0]]
        if isinstance(owner, LoraLayer):
            applied.update(_lora_plan(owner, name, style, tp_mesh))
        elif _is_owned(owner):  # a pipeline rank shards only the layers it holds
            applied[name] = style
            owner.__dict__[TP_STYLE_ATTR] = style
    # transformers' styles shard a parameter before the forward of its module is hooked.
    ordered = dict(sorted(applied.items(), key=lambda item: item[0] in modules))
    apply_tensor_parallelism(model, tp_mesh, ordered)
    base, _ = _base_model(model)
    if getattr(base.config.get_text_config(), "tie_word_embeddings", False):
        # The embeddings and the head were split one after the other into two parameters (both by vocabulary
        # rows, Shard(0)); one process trains a single tied weight, so tie them again.
        base.tie_weights()
    return ordered


def _lora_plan(layer, name: str, style: str, tp_mesh) -> Dict[str, str]:
    """peft's rule for an adapted target: the base layer and one adapter factor take the target's style."""
    from torch.distributed.tensor import Replicate, Shard

    if style not in ("colwise", "rowwise"):
        raise FtctlError(f"{name}: tensor-parallel style {style!r} has no LoRA rule (peft shards colwise and rowwise targets); "
                         "leave it out of method.target_modules")
    base = layer.get_base_layer()
    if not _is_owned(base):
        return {}
    plan = {f"{name}.base_layer.{p}": style for p, _ in base.named_parameters(recurse=False)}
    plan[f"{name}.base_layer"] = style
    base.__dict__[TP_STYLE_ATTR] = style
    factor = "lora_B" if style == "colwise" else "lora_A"
    for adapter in layer.lora_A:
        plan[f"{name}.{factor}.{adapter}.weight"] = style
        plan[f"{name}.{factor}.{adapter}"] = style
        if adapter in getattr(layer, "lora_magnitude_vector", {}):
            dora = layer.lora_magnitude_vector[adapter]
            # The magnitude scales output rows: split with them (colwise), whole for a row split.
            placement = Shard(0) if style == "colwise" else Replicate()
            from torch.distributed.tensor import distribute_tensor

            dora.weight = torch.nn.Parameter(distribute_tensor(dora.weight.detach(), tp_mesh, [placement], src_data_rank=None))
            dora.__dict__[TP_STYLE_ATTR] = style
            dora.forward = types.MethodType(dora_forward_tensor_parallel, dora)
    return plan


def dora_forward_tensor_parallel(self, x, *, lora_A, lora_B, scaling, base_layer, base_result=None, adapter_name="default"):
    """peft's DoRA term (``DoraLinearLayer.forward``) for a tensor-parallel layer.

    The weight-space part, ``m / ||W + s·B·A||`` per output row, runs on the DTensors, so a row
    split's partial norms are summed over the ranks; the activations stay the local tensors the
    base layer and the adapter's TP hooks pass around. Same formula, ``||·||`` detached as in peft.
    """
    from torch.distributed.tensor import DTensor, Replicate

    style = self.__dict__[TP_STYLE_ATTR]
    weight = base_layer.weight
    mesh = weight.device_mesh

    def whole(t):
        return t if isinstance(t, DTensor) else DTensor.from_local(t, mesh, [Replicate()], run_check=False)

    with torch.no_grad():
        lora_weight = whole(lora_B.weight) @ whole(lora_A.weight)
        norm = torch.linalg.vector_norm(weight.to(lora_weight.dtype) + scaling * lora_weight, dim=1)
    scale = self.weight / norm
    scale = (scale.to_local() if style == "colwise" else scale.full_tensor()).view(1, -1)
    lora_result = lora_B(lora_A(x))
    if base_result is None:
        base_result = base_layer(x)
    bias = getattr(base_layer, "bias", None)
    if bias is not None:
        base_result = base_result - (bias.to_local() if style == "colwise" else bias.full_tensor())
    return (scale - 1) * base_result + scale * lora_result * scaling


def apply_expert_parallel(model: torch.nn.Module, ep_mesh, tp_mesh) -> Dict[str, str]:
    """Whole experts per rank by the model's ``base_model_ep_plan`` (transformers' token dispatch); returns the plan."""
    from transformers.distributed.expert_parallel import apply_expert_parallelism

    _, plan = model_plans(model, tp_mesh.size(), ep_mesh.size())
    if not plan:
        raise FtctlError(f"{type(_base_model(model)[0]).__name__} has no expert-parallel plan; use parallel.ep_size=1")
    apply_expert_parallelism(model, ep_mesh, tp_mesh, plan)
    return plan


def expert_modules(model: torch.nn.Module, ep_plan: Optional[Dict[str, str]]):
    """The modules whose experts the plan dispatches (FSDP shards them over the expert mesh)."""
    if not ep_plan:
        return []
    modules = dict(model.named_modules())
    return [modules[name] for name, style in ep_plan.items() if style == "ep_dispatch_experts" and name in modules]
