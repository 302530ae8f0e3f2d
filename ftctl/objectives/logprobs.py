"""Per-sequence log-probabilities of a preference micro-batch, and a loss computed from them, in fp32.

A preference loss is a function of each answer's summed token log-probability. As for SFT
(:mod:`ftctl.training.loss`), where the model's forward returns ``lm_head(hidden)`` unchanged the
output head is made to compute the result itself for one forward call, so full-vocabulary logits
never exist: :class:`SequenceLogProbLoss` runs the trained positions through the head weight in
chunks, sums each position's log-probability into its sequence, evaluates the loss on those sums,
and then, knowing the loss's gradient with respect to every sequence, runs the chunks once more to
turn each chunk's softmax into its gradients. Nothing of the head's weight is kept for backward
(which sharded backends would have released by then): backward only scales the gradients already
computed. Any other model takes the plain path, full logits and ``log_softmax``, with autograd.

Matmuls run in the autocast dtype when autocast is on; softmax, log-probabilities, their sums and
the loss are fp32 whatever the compute precision.
"""

from __future__ import annotations

from typing import Callable, Optional, Tuple

import torch

from ftctl.models.packed_attention import packed_kernel_of
from ftctl.training.loss import head_chunking, head_computes, head_for_loss
from ftctl.training.loss import _to_device as _on

LossFn = Callable[[torch.Tensor], torch.Tensor]


def sequence_logps(module: torch.nn.Module, batch, device) -> torch.Tensor:
    """Summed log-probability of each sequence's trained tokens, (num_sequences,) fp32; call under no_grad."""
    _, logps = sequence_loss(module, batch, device, None)
    return logps


def sequence_loss(module: torch.nn.Module, batch, device, loss_fn: Optional[LossFn]) -> Tuple[Optional[torch.Tensor], torch.Tensor]:
    """(``loss_fn(sequence log-probs)``, the detached sequence log-probs) for one micro-batch; no loss when ``loss_fn`` is None."""
    inputs = batch.model_inputs(device, packed_kernel=packed_kernel_of(module))
    positions, targets = _on(batch.loss_positions, device), _on(batch.loss_targets, device)
    sequences = _on(batch.loss_sequences, device)
    count = batch.num_sequences
    head = head_for_loss(module)
    if head is None:
        logits = module(**inputs, use_cache=False).logits
        flat = logits.reshape(-1, logits.shape[-1]).index_select(0, positions)
        with torch.autocast(flat.device.type, enabled=False):
            token_logps = flat.float().log_softmax(-1).gather(1, targets[:, None]).squeeze(1)
            logps = torch.zeros(count, dtype=torch.float32, device=token_logps.device).index_add(0, sequences, token_logps)
            return (loss_fn(logps) if loss_fn is not None else None), logps.detach()
    out = {}

    def in_head(hidden: torch.Tensor) -> torch.Tensor:
        selected = hidden.reshape(-1, hidden.shape[-1]).index_select(0, positions)
        return SequenceLogProbLoss.apply(selected, head.weight, head.bias, targets, sequences, count, loss_fn,
                                         torch.is_grad_enabled(), out)

    with head_computes(head, in_head):
        loss = module(**inputs, use_cache=False).logits  # the head returned the loss in place of the logits
    return (loss if loss_fn is not None else None), out["sequence_logps"]


class SequenceLogProbLoss(torch.autograd.Function):
    """``loss_fn(per-sequence sums of log_softmax(hidden @ weight.T + bias)[target])``, chunk by chunk.

    First pass: each chunk's logits give its positions' log-probabilities (and log-sum-exps), summed
    into their sequences. The loss and its gradient with respect to the sums come from ``loss_fn``
    under autograd, on a handful of numbers. Second pass (only when gradients are wanted): each
    chunk's logits again, whose softmax becomes ``g · (one_hot − softmax)``, g being the gradient of
    the position's sequence, multiplied straight into the gradients of ``hidden``, ``weight`` and ``bias``.
    """

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, sequences, count: int, loss_fn, track_grads: bool, out: dict):
        device = hidden.device
        compute_dtype, rows, w, b, (want_hidden_grad, want_weight_grad, want_bias_grad) = head_chunking(
            ctx, hidden, weight, bias, track_grads)
        n = hidden.shape[0]
        vocab = weight.shape[0]
        with torch.autocast(device.type, enabled=False):

            def chunk_logits(start: int, end: int) -> torch.Tensor:
                logits = torch.mm(hidden[start:end].to(compute_dtype), w.t()).float()
                return logits + b if b is not None else logits

            token_logps = torch.empty(n, dtype=torch.float32, device=device)
            log_norms = torch.empty(n, dtype=torch.float32, device=device)
            for start in range(0, n, rows):
                end = min(start + rows, n)
                logits = chunk_logits(start, end)
                log_norms[start:end] = torch.logsumexp(logits, dim=1)
                token_logps[start:end] = logits.gather(1, targets[start:end, None]).squeeze(1) - log_norms[start:end]
            logps = torch.zeros(count, dtype=torch.float32, device=device).index_add_(0, sequences, token_logps)
            out["sequence_logps"] = logps
            if loss_fn is None:
                ctx.present = (False, False, False)
                return logps.new_zeros(())
            with torch.enable_grad():
                leaf = logps.detach().requires_grad_(True)
                loss = loss_fn(leaf)
                wanted = want_hidden_grad or want_weight_grad or want_bias_grad
                grad_sequences = torch.autograd.grad(loss, leaf)[0] if wanted else None
            grad_hidden = torch.empty(hidden.shape, dtype=torch.float32, device=device) if want_hidden_grad else None
            grad_weight = torch.zeros(weight.shape, dtype=torch.float32, device=device) if want_weight_grad else None
            grad_bias = torch.zeros(vocab, dtype=torch.float32, device=device) if want_bias_grad else None
            if grad_sequences is not None:
                grad_positions = grad_sequences.float().index_select(0, sequences)
                for start in range(0, n, rows):
                    end = min(start + rows, n)
                    # d(log p[target]) / d(logits) = one_hot(target) - softmax, times the sequence's gradient
                    g = grad_positions[start:end, None]
                    grad_logits = chunk_logits(start, end).sub_(log_norms[start:end, None]).exp_().mul_(-g)
                    grad_logits[torch.arange(end - start, device=device), targets[start:end]] += g.squeeze(1)
                    if grad_hidden is not None:
                        grad_hidden[start:end] = torch.mm(grad_logits.to(compute_dtype), w).float()
                    if grad_weight is not None:
                        grad_weight.addmm_(grad_logits.t(), hidden[start:end].float())
                    if grad_bias is not None:
                        grad_bias += grad_logits.sum(dim=0)
        ctx.save_for_backward(*(x if x is not None else torch.empty(0) for x in (grad_hidden, grad_weight, grad_bias)))
        ctx.present = (grad_hidden is not None, grad_weight is not None, grad_bias is not None)
        ctx.dtypes = (hidden.dtype, weight.dtype, bias.dtype if bias is not None else None)
        return loss.detach().float()

    @staticmethod
    def backward(ctx, grad_output):
        if not any(ctx.present):
            return (None,) * 9
        saved = ctx.saved_tensors
        grads = [(g * grad_output).to(dtype) if present else None for g, present, dtype in zip(saved, ctx.present, ctx.dtypes)]
        return grads[0], grads[1], grads[2], None, None, None, None, None, None

