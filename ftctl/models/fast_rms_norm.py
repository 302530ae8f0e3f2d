"""RMSNorm as one autograd node: the same function as transformers' Llama-family RMSNorm, a third of the time.

transformers writes RMSNorm as five tensor ops (``pow``, ``mean``, ``rsqrt``, two products), and
autograd runs a backward for each: about a dozen passes over the activations per norm and call,
two norms per decoder layer. On CPUs that is several percent of a LoRA step. :class:`RMSNormFunction`
computes the same forward with one reduction (``vector_norm``) and one product, keeps the input and
1/rms, and writes the input's gradient in closed form:

    y = w · x̂,  x̂ = x / rms(x)      ∂L/∂x = (g·w − x̂ · mean(g·w · x̂)) / rms(x)

Numerics follow transformers: statistics in fp32, the normalised value cast back to the input's
dtype before the weight multiplies it. The swap covers only classes whose forward is exactly that
(:data:`SAME_AS_LLAMA`); Gemma's ``1 + w`` variant and anything unknown keep their own forward.
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


def fast_rms_norm_forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
    return RMSNormFunction.apply(hidden_states, self.weight, self.variance_epsilon)


def use_fast_rms_norm(model: torch.nn.Module) -> int:
    """Give every Llama-style RMSNorm of ``model`` the one-node forward; returns how many."""
    swapped = 0
    for module in model.modules():
        if type(module).__name__ in SAME_AS_LLAMA and hasattr(module, "variance_epsilon"):
            module.forward = types.MethodType(fast_rms_norm_forward, module)
            swapped += 1
    return swapped
