"""The loss: a sum of token cross-entropies, so the caller can normalise by the global batch's trained tokens.

The costly part of a causal-LM loss is the output head: full (batch, length, vocabulary) fp32
logits, their log-softmax and their gradient are each as large as many layers' activations put
together, and most positions (prompt, padding) do not even train. So where the model's forward is
known to return ``lm_head(hidden)`` unchanged, the head is made to compute the loss itself for
the duration of one forward call: it keeps only the positions that carry a trained label, and
runs them through the head weight in chunks, each chunk's softmax turned into its gradient right
away (:class:`LinearCrossEntropy`). The full logits never exist, and the backward pass is two
scalings. The head stays the model's own module, called inside the model's own forward, so
wrappers (peft, DDP, FSDP, DeepSpeed) see the calls they expect. Any other model takes the plain
path: full logits, then ``cross_entropy``.
"""

from __future__ import annotations

import contextlib
from typing import Optional

import torch
import torch.nn.functional as F

from ftctl.data.render import IGNORE_INDEX
from ftctl.models.architecture import HEAD_RETURNS_PLAIN_LOGITS
from ftctl.models.kernels import head_loss_kernel
from ftctl.models.packed_attention import packed_kernel_of

#: Logits held at once per chunk (fp32): 8 Mi elements = 32 MiB, large enough for efficient matmuls.
CHUNK_ELEMENTS = 1 << 23



def next_token_targets(labels: torch.Tensor) -> torch.Tensor:
    """The label each position predicts (the next token's), ignored at the last position."""
    targets = torch.full_like(labels, IGNORE_INDEX)
    targets[:, :-1] = labels[:, 1:]
    return targets


def token_loss_sum(module: torch.nn.Module, batch, device: torch.device) -> torch.Tensor:
    """Sum of the cross-entropies of every trained token of ``batch`` (padded or packed).

    Nothing here reads a device tensor back: which positions train is worked out on the host, by the
    collator, and only the answer is copied to the device.
    """
    inputs = batch.model_inputs(device, packed_kernel=packed_kernel_of(module))
    head = head_for_loss(module)
    if head is None:
        logits = module(**inputs, use_cache=False).logits
        return F.cross_entropy(
            logits.float().reshape(-1, logits.size(-1)), _to_device(next_token_targets(batch.labels), device).reshape(-1),
            ignore_index=IGNORE_INDEX, reduction="sum",
        )
    positions, trained_targets = batch.loss_positions, batch.loss_targets
    if positions is None:  # a batch not built by ftctl.data.batching
        flat = next_token_targets(batch.labels).reshape(-1)
        positions = (flat != IGNORE_INDEX).nonzero().squeeze(1)
        trained_targets = flat[positions]
    with _head_computes_loss(head, _to_device(positions, device), _to_device(trained_targets, device)):
        # The head returned the loss in place of the logits.
        return module(**inputs, use_cache=False).logits


def loss_sum_for_targets(module: torch.nn.Module, inputs: dict, targets: torch.Tensor) -> torch.Tensor:
    """Summed cross-entropy of ``module(**inputs)`` against next-token ``targets`` (IGNORE_INDEX where nothing trains).

    For callers that hold the targets as a tensor on the device (a pipeline's last stage) rather than a batch.
    """
    head = head_for_loss(module)
    if head is None:
        logits = module(**inputs).logits
        return F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1),
                               ignore_index=IGNORE_INDEX, reduction="sum")
    flat = targets.reshape(-1)
    positions = (flat != IGNORE_INDEX).nonzero().squeeze(1)
    with _head_computes_loss(head, positions, flat[positions]):
        return module(**inputs).logits


def _to_device(host: torch.Tensor, device) -> torch.Tensor:
    """An asynchronous copy to a GPU (from page-locked memory); the tensor itself elsewhere."""
    device = torch.device(device)
    if device.type != "cuda":
        return host.to(device)
    return (host if host.is_pinned() else host.pin_memory()).to(device, non_blocking=True)


def head_for_loss(module: torch.nn.Module) -> Optional[torch.nn.Linear]:
    """The output head if it can compute the loss itself (see the module docstring), else None."""
    inner = module
    # DDP and DeepSpeed keep the model in `.module`; peft and FSDP2 answer for the model directly.
    while not hasattr(inner, "get_output_embeddings"):
        inner = getattr(inner, "module", None)
        if not isinstance(inner, torch.nn.Module):
            return None
    head = inner.get_output_embeddings()
    # A quantised, adapted or wrapped head (bitsandbytes, a LoRA layer on lm_head, modules_to_save)
    # does not hold a plain (vocab, hidden) weight; it takes the plain path.
    if not isinstance(head, torch.nn.Linear) or tuple(head.weight.shape) != (head.out_features, head.in_features):
        return None
    if not head.weight.dtype.is_floating_point:
        return None
    mesh = getattr(head.weight, "device_mesh", None)
    if mesh is not None and "tp" in (mesh.mesh_dim_names or ()):
        return None  # split over the vocabulary by tensor parallelism: its rows are not all here
    return head if returns_head_output(inner) else None


#: Where :func:`returns_head_output` keeps its verdict on the model (one probe per model).
_VERDICT = "_ftctl_returns_head_output"


def returns_head_output(model: torch.nn.Module) -> bool:
    """Whether ``model``'s forward returns its output head's result unchanged as ``.logits``.

    Decided by what the forward does, not by the family's name: the head is made to return a
    marker tensor for one forward of two tokens, and the logits must be that very tensor. Granite's
    logit scaling and Gemma's final soft-capping compute a new tensor, so those models take the
    plain loss path. Called once before training (:func:`ftctl.training.runner`), before any
    wrapper; the verdict is kept on the model. Falls back to the verified families of
    :data:`HEAD_RETURNS_PLAIN_LOGITS` for a model the probe cannot run on (meta weights).
    """
    verdict = model.__dict__.get(_VERDICT)
    if verdict is not None:
        return verdict
    head = model.get_output_embeddings()
    weight = getattr(head, "weight", None)
    if weight is None or weight.device.type == "meta":
        return getattr(getattr(model, "config", None), "model_type", None) in HEAD_RETURNS_PLAIN_LOGITS
    marker = []

    def marked(hidden: torch.Tensor) -> torch.Tensor:
        marker.append(hidden.new_zeros(hidden.shape[:-1] + (head.out_features,)))
        return marker[-1]

    previous = head.__dict__.get("forward")
    head.forward = marked
    try:
        with torch.no_grad():
            logits = model(input_ids=torch.zeros((1, 2), dtype=torch.long, device=weight.device), use_cache=False).logits
        verdict = len(marker) == 1 and logits is marker[0]
    except (RuntimeError, TypeError, ValueError):
        verdict = False
    finally:
        if previous is None:
            del head.forward
        else:
            head.forward = previous
    model.__dict__[_VERDICT] = verdict
    return verdict


@contextlib.contextmanager
def head_computes(head: torch.nn.Module, compute):
    """For one forward call, ``head(hidden)`` returns ``compute(hidden)`` in place of the logits (see the module docstring)."""
    previous = head.__dict__.get("forward")
    head.forward = compute
    try:
        yield
    finally:
        if previous is None:
            del head.forward
        else:
            head.forward = previous


def _head_computes_loss(head: torch.nn.Linear, positions: torch.Tensor, targets: torch.Tensor):
    """For one forward call, ``head(hidden)`` returns the summed token loss of ``hidden``'s flattened
    ``positions`` against ``targets``."""
    kernel = head_loss_kernel(head)
    return head_computes(head, lambda hidden: linear_cross_entropy_at(hidden, head.weight, head.bias, positions, targets, kernel))


def linear_cross_entropy_sum(hidden, weight, bias, targets) -> torch.Tensor:
    """``cross_entropy(hidden @ weight.T + bias, targets, reduction="sum")`` over the non-ignored targets only."""
    flat = targets.reshape(-1)
    positions = (flat != IGNORE_INDEX).nonzero().squeeze(1)
    return linear_cross_entropy_at(hidden, weight, bias, positions, flat[positions])


def linear_cross_entropy_at(hidden, weight, bias, positions, targets, kernel=None) -> torch.Tensor:
    """Summed cross-entropy of ``hidden``'s flattened ``positions`` (index tensor) against ``targets``.

    An index, unlike a boolean mask, has a size the host already knows: selecting by it reads nothing back.
    ``kernel(selected, weight, bias, targets)`` computes it instead of :class:`LinearCrossEntropy` when
    given (``train.kernels``, :mod:`ftctl.models.kernels`).
    """
    if positions.numel() == 0:
        return hidden.sum() * 0.0  # keeps the graph connected for a micro-batch with nothing to train
    selected = hidden.reshape(-1, hidden.shape[-1]).index_select(0, positions)
    if kernel is not None:
        return kernel(selected, weight, bias, targets)
    return LinearCrossEntropy.apply(selected, weight, bias, targets, torch.is_grad_enabled())


def head_chunking(ctx, hidden: torch.Tensor, weight: torch.Tensor, bias, track_grads: bool):
    """How a chunked head function computes: (the dtype its matmuls run in: autocast's when it is on, else the
    input's; rows per chunk, so that a chunk's fp32 logits hold about CHUNK_ELEMENTS; the weight in that dtype;
    the bias in fp32; whether hidden, weight and bias want gradients)."""
    device_type = hidden.device.type
    compute_dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else hidden.dtype
    # Grad mode is off inside forward; the caller's mode says whether anything will call backward.
    wants = tuple(track_grads and need for need in ctx.needs_input_grad[:3])
    return (compute_dtype, max(1, CHUNK_ELEMENTS // weight.shape[0]), weight.to(compute_dtype),
            bias.float() if bias is not None else None, wants)


class LinearCrossEntropy(torch.autograd.Function):
    """Summed cross-entropy of ``hidden @ weight.T + bias``, chunk by chunk, gradients computed on the way.

    Each chunk's logits become softmax - one-hot (the gradient of the summed loss) in place and are
    multiplied straight into the gradients of ``hidden`` and ``weight``; backward only scales them.
    No logits outlive their chunk, and none is computed twice. Matmuls run in the autocast dtype when
    autocast is on; softmax and gradient accumulation stay fp32.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, track_grads: bool):
        device = hidden.device
        compute_dtype, rows, w, b, (want_hidden_grad, want_weight_grad, want_bias_grad) = head_chunking(
            ctx, hidden, weight, bias, track_grads)
        n, vocab = hidden.shape[0], weight.shape[0]
        with torch.autocast(device.type, enabled=False):
            grad_hidden = torch.empty(hidden.shape, dtype=torch.float32, device=device) if want_hidden_grad else None
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=device) if want_weight_grad else None
            grad_bias = torch.zeros(vocab, dtype=torch.float32, device=device) if want_bias_grad else None
            total = torch.zeros((), dtype=torch.float64, device=device)
            fp32 = compute_dtype == torch.float32
            buffer = torch.empty((min(rows, n), vocab), dtype=torch.float32, device=device) if fp32 else None
            for start in range(0, n, rows):
                end = min(start + rows, n)
                h = hidden[start:end].to(compute_dtype)
                t = targets[start:end]
                if fp32:
                    logits = torch.mm(h, w.t(), out=buffer[: end - start])
                else:
                    logits = torch.mm(h, w.t()).float()
                if b is not None:
                    logits += b
                target_logit = logits.gather(1, t[:, None]).squeeze(1)
                peak = logits.amax(dim=1, keepdim=True)
                logits.sub_(peak).exp_()
                norm = logits.sum(dim=1, keepdim=True)
                total += (peak.squeeze(1) + norm.log().squeeze(1) - target_logit).sum(dtype=torch.float64)
                if grad_hidden is None and grad_weight is None and grad_bias is None:
                    continue
                # d(sum of losses)/d(logits) = softmax - one_hot(target)
                grad_logits = logits.div_(norm)
                grad_logits[torch.arange(end - start, device=device), t] -= 1.0
                if grad_hidden is not None:
                    if fp32:
                        torch.mm(grad_logits, w, out=grad_hidden[start:end])
                    else:
                        grad_hidden[start:end] = torch.mm(grad_logits.to(compute_dtype), w)
                if grad_weight is not None:
                    grad_weight.addmm_(grad_logits.t(), h.float())
                if grad_bias is not None:
                    grad_bias += grad_logits.sum(dim=0)
        ctx.save_for_backward(
            *(x if x is not None else torch.empty(0) for x in (grad_hidden, grad_weight, grad_bias))
        )
        ctx.present = (grad_hidden is not None, grad_weight is not None, grad_bias is not None)
        ctx.dtypes = (hidden.dtype, weight.dtype, bias.dtype if bias is not None else None)
        return total.float()

    @staticmethod
    def backward(ctx, grad_output):
        saved = ctx.saved_tensors
        grads = [
            (g * grad_output).to(dtype) if present else None
            for g, present, dtype in zip(saved, ctx.present, ctx.dtypes)
        ]
        return grads[0], grads[1], grads[2], None, None
