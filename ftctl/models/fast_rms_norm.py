"""RMSNorm as one autograd node: the same function as transformers' Llama-family RMSNorm, a third of the time.

transformers writes RMSNorm as five tensor ops (``pow``, ``mean``, ``rsqrt``, two products), and
autograd runs a backward for each: about a dozen passes over the activations per norm and call,
two norms per decoder layer. On CPUs that is several percent of a LoRA step. :class:`RMSNormFunction`
computes the same forward with one reduction (``vector_norm``) and one product, keeps the input and
1/rms, and writes the input's gradient in closed form:

    y = w · x̂,  x̂ = x / rms(x)      ∂L/∂x = (g·w − x̂ · mean(g·w · x̂)) / rms(x)

Numerics follow transformers: statistics in fp32, the normalised value cast back to the input's
dtype before the weight multiplies it (Llama's order). Other families write the same norm with
the product in fp32 (OLMo2, GPT-OSS) or a ``1 + w`` scale (Gemma); each variant is one of
:data:`VARIANTS`. Which one a module computes is decided by its capability, not its class name:
:func:`rms_norm_variant` runs the module's own forward on a probe input in fp32 and bf16 and
takes the variant that gives the same values and dtype. Anything else (LayerNorm, biases, a norm
that matches no variant) keeps its own forward.
"""

from __future__ import annotations

import types

import torch

# RMSNorm classes whose forward is LlamaRMSNorm's, checked by tests/test_fast_rms_norm.py.
SAME_AS_LLAMA = frozenset({"LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm"})


class RMSNormFunction(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        x32 = x.float()
        # rms = ‖x‖ / √n: one fused reduction instead of pow, then mean.
        rstd = torch.linalg.vector_norm(x32, dim=-1, keepdim=True).div_(x.shape[-1] ** 0.5).square_().add_(eps).rsqrt_()
        normed32 = x32 * rstd
        # In fp32, x̂ is kept (as large as x, and backward needs it); otherwise x is, the smaller of the two.
        ctx.save_for_backward(normed32 if x.dtype == torch.float32 else x, weight, rstd)
        return weight * normed32.to(x.dtype)

    @staticmethod
    def backward(ctx, grad_out: torch.Tensor):
        kept, weight, rstd = ctx.saved_tensors
        dtype = kept.dtype
        normed32 = kept if dtype == torch.float32 else kept.float() * rstd
        grad_x = grad_weight = None
        if ctx.needs_input_grad[0]:
            # Rounded to the input dtype first, as autograd does through transformers' cast.
            grad_normed = (grad_out * weight).to(dtype).float()
            mean_dot = (grad_normed * normed32).sum(-1, keepdim=True).div_(normed32.shape[-1])
            grad_x = torch.addcmul(grad_normed, normed32, mean_dot, value=-1).mul_(rstd).to(dtype)
        if ctx.needs_input_grad[1]:
            products = grad_out * normed32.to(dtype)
            grad_weight = products.reshape(-1, products.shape[-1]).sum(0).to(weight.dtype)
        return grad_x, grad_weight, None


def _eps(module: torch.nn.Module):
    eps = getattr(module, "variance_epsilon", getattr(module, "eps", None))
    return eps if isinstance(eps, float) else None


def fast_rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """``w · x̂`` with x̂ rounded to the input dtype first (Llama)."""
    return RMSNormFunction.apply(hidden_states, self.weight, _eps(self))


def fast_rms_norm_fp32_product_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """``w · x̂`` in fp32, then rounded to the input dtype (OLMo2, GPT-OSS)."""
    return RMSNormFunction.apply(hidden_states.float(), self.weight.float(), _eps(self)).to(hidden_states.dtype)


def fast_rms_norm_one_plus_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    """``(1 + w) · x̂`` in fp32, then rounded to the input dtype (Gemma; its weight is stored as an offset from 1)."""
    return RMSNormFunction.apply(hidden_states.float(), 1.0 + self.weight.float(), _eps(self)).to(hidden_states.dtype)


#: The RMSNorm formulas the one-node function covers, tried in this order.
VARIANTS = {
    "weight": fast_rms_norm_forward,
    "weight_fp32": fast_rms_norm_fp32_product_forward,
    "one_plus_weight": fast_rms_norm_one_plus_forward,
}


def rms_norm_variant(module: torch.nn.Module):
    """The :data:`VARIANTS` key whose forward equals ``module``'s own on a probe input, or None.

    Candidates are leaf modules whose only parameter is a 1-D ``weight`` next to a float epsilon.
    The probe compares values in fp32 and values and dtype in bf16 (where the variants round
    differently), so a norm with another formula or another output dtype keeps its forward.
    """
    params = dict(module.named_parameters(recurse=False))
    weight = params.get("weight")
    if (len(params) != 1 or weight is None or weight.ndim != 1 or not weight.dtype.is_floating_point
            or weight.device.type == "meta" or _eps(module) is None or next(module.children(), None) is not None):
        return None
    generator = torch.Generator().manual_seed(0)
    probe = (torch.randn(2, weight.shape[0], generator=generator) * 3).to(weight.device)
    own = type(module).forward
    matched = None
    try:
        with torch.no_grad():
            for name, forward in VARIANTS.items():
                if all(_same(own(module, probe.to(dtype)), forward(module, probe.to(dtype)), dtype)
                       for dtype in (torch.float32, torch.bfloat16)):
                    matched = name
                    break
    except (RuntimeError, TypeError):
        return None
    return matched


def _same(expected: torch.Tensor, got: torch.Tensor, dtype: torch.dtype) -> bool:
    if not isinstance(expected, torch.Tensor) or expected.dtype != got.dtype or expected.shape != got.shape:
        return False
    tolerance = {"rtol": 1e-5, "atol": 1e-6} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 1e-2}
    return torch.allclose(got.float(), expected.float(), **tolerance)


def use_fast_rms_norm(model: torch.nn.Module) -> int:
    """Give every RMSNorm of ``model`` that computes one of :data:`VARIANTS` the one-node forward; returns how many."""
    swapped = 0
    verdicts = {}  # one probe per class and weight dtype: a model has hundreds of identical norms
    for module in model.modules():
        weight = getattr(module, "weight", None)
        key = (type(module), getattr(weight, "dtype", None))
        if key not in verdicts:
            verdicts[key] = rms_norm_variant(module)
        variant = verdicts[key]
        if variant is not None and _eps(module) is not None:
            module.forward = types.MethodType(VARIANTS[variant], module)
            swapped += 1
    return swapped
