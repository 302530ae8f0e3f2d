"""A shorter forward for peft's plain LoRA linear layers: the same function, fewer passes over the output.

peft computes ``base(x) + lora_B(lora_A(dropout(x))) * scaling``: after the matmuls, one pass to
scale the low-rank output, one to add it, one more in backward for the scaling, and dropout's own
pass to scale the kept inputs. Here the low-rank update is added into the base output by the
matmul that produces it (``base(x).addmm_(x_A, B.T, alpha=scaling)``), and dropout's 1/(1-p)
joins ``alpha``, so it acts on the rank-r intermediate rather than on full-width activations. On
CPUs in fp32, the dropped input of ``lora_A`` is not kept for backward either
(:class:`DroppedLowRank`): backward rebuilds it from the layer input, which the sibling projections
share, and the dropout's 16-bit random numbers.

The adapter weights, their names, saving, merging and every other peft behaviour stay peft's: the
swap only replaces the forward of layers in the plain configuration (one active adapter, no DoRA,
unmerged, a plain ``nn.Linear`` base, weights not split by tensor parallelism) and falls back to
peft's own forward whenever the layer is in any other state.
"""

from __future__ import annotations

import types

import torch
import torch.nn.functional as F

from ftctl.methods.dropout import BitsDropout, keep_from_bits


def use_fused_lora_forward(model: torch.nn.Module) -> int:
    """Give every plain peft ``lora.Linear`` of ``model`` the fused forward; returns how many."""
    from peft.tuners.lora.layer import Linear as LoraLinear

    swapped = 0
    for module in model.modules():
        if type(module) is LoraLinear and type(module.base_layer) is torch.nn.Linear:
            module.forward = types.MethodType(fused_lora_forward, module)
            swapped += 1
    return swapped


def _plain_adapter(layer, args, kwargs):
    """The active adapter's name if the layer is in the plain LoRA state, else None."""
    if args or kwargs or layer.disable_adapters or layer.merged:
        return None
    active = layer.active_adapters
    if len(active) != 1:
        return None
    name = active[0]
    if name not in layer.lora_A or name in getattr(layer, "lora_variant", {}) or layer.use_dora.get(name, False):
        return None
    if layer.lora_B[name].bias is not None:
        return None
    # Tensor-parallel shards (DTensors through the forward, unlike FSDP's, which are gathered by then) take peft's
    # forward, whose sub-layers carry the split's input and output conversions.
    if any(hasattr(w, "placements") for w in (layer.base_layer.weight, layer.lora_A[name].weight, layer.lora_B[name].weight)):
        return None
    return name


def fused_lora_forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
    name = _plain_adapter(self, args, kwargs)
    if name is None:
        return type(self).forward(self, x, *args, **kwargs)
    shape = x.shape
    # 2-D from the start, so the low-rank update can be added into the base output in place: an
    # in-place op on a reshaped view would make autograd copy the whole gradient (CopySlices).
    x = x.reshape(-1, shape[-1])
    result = self.base_layer(x)
    lora_a, lora_b = self.lora_A[name].weight, self.lora_B[name].weight
    x = x.to(lora_a.dtype)
    dropout = self.lora_dropout[name]
    scaling = self.scaling[name]
    if isinstance(dropout, BitsDropout) and dropout.active_on(x):
        scaling = scaling * dropout.scale
        if torch.is_autocast_enabled("cpu"):
            low_rank = F.linear(x * dropout.keep_mask(x), lora_a)
        else:
            low_rank = DroppedLowRank.apply(x, lora_a, dropout.random_bits(x), dropout.threshold)
    else:
        low_rank = F.linear(dropout(x), lora_a)
    if torch.is_autocast_enabled(result.device.type):
        result = torch.addmm(result, low_rank, lora_b.t(), alpha=scaling)  # autocast casts addmm, not addmm_
    elif result.dtype != low_rank.dtype:
        result = result + (F.linear(low_rank, lora_b) * scaling).to(result.dtype)
    else:
        # The base layer's backward does not need its output, so adding into it is safe.
        result = result.addmm_(low_rank, lora_b.t(), alpha=scaling)
    return result.view(*shape[:-1], result.shape[-1])


class DroppedLowRank(torch.autograd.Function):
    """``(x * keep) @ weight.T`` for 2-D ``x``, with ``keep = bits >= threshold``, keeping only ``x`` and ``bits``.

    Autograd would keep the dropped input (4 bytes an element, one copy per projection) and the
    mask; this keeps the undropped input, one tensor shared by q/k/v and by gate/up, plus 2 bytes
    of random bits an element, and spends one multiplication in backward to rebuild the rest.
    """

    @staticmethod
    def forward(ctx, x, weight, bits, threshold: int):
        dropped = keep_from_bits(bits, threshold, x.dtype).mul_(x)
        ctx.save_for_backward(x, weight, bits)
        ctx.threshold = threshold
        return F.linear(dropped, weight)

    @staticmethod
    def backward(ctx, grad_out):
        x, weight, bits = ctx.saved_tensors
        keep = keep_from_bits(bits, ctx.threshold, x.dtype)
        grad_x = grad_weight = None
        if ctx.needs_input_grad[0]:
            grad_x = grad_out.mm(weight).mul_(keep)
        if ctx.needs_input_grad[1]:
            grad_weight = grad_out.t().mm(keep.mul_(x))
        return grad_x, grad_weight, None, None
