"""The preference losses, as functions of per-sequence log-probabilities (fp32), one value per example.

Each takes the summed log-probability of every answer under the policy (and, where the objective has
one, under the reference model) and the answer's token count, and returns the per-example losses with
the implicit rewards that the metrics report. Nothing here knows about models or batches, so the
formulas can be checked against the papers and against TRL on the same numbers (tests/test_objectives.py).

- DPO (Rafailov et al. 2023), with h = (log π(y_w) − log π_ref(y_w)) − (log π(y_l) − log π_ref(y_l)):
  ``sigmoid`` −(1−ε)·log σ(βh) − ε·log σ(−βh) (ε = label_smoothing: conservative DPO);
  ``robust`` (Chowdhury et al. 2024) (−(1−ε)·log σ(βh) + ε·log σ(−βh)) / (1−2ε);
  ``hinge`` (SLiC, Zhao et al. 2023) max(0, 1 − βh);
  ``ipo`` (Azar et al. 2023) (h̄ − 1/(2β))², h̄ with each log-ratio divided by its answer's token count
  (as TRL does, confirmed with IPO's authors).
- SimPO (Meng et al. 2024): −(1−ε)·log σ(m) − ε·log σ(−m), m = β·(mean log π(y_w) − mean log π(y_l)) − γ.
- ORPO (Hong et al. 2024): NLL(y_w) − λ·log σ(log odds(y_w) − log odds(y_l)), odds(y) = P(y)/(1−P(y)) with P
  the mean token probability (exp of the mean log-probability); NLL is the mean token NLL of y_w.
- KTO (Ethayarajh et al. 2024): desirable answers 1 − σ(β(r − z)), undesirable 1 − σ(β(z − r)), each weighted,
  r = log π(y) − log π_ref(y) and z the detached KL estimate, clamped at 0.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn.functional as F

_LN_HALF = -math.log(2.0)


@dataclass
class ExampleLosses:
    losses: torch.Tensor  # one per example
    chosen_rewards: torch.Tensor  # KTO: the reward of every example (desirable or not)
    rejected_rewards: Optional[torch.Tensor] = None


def dpo(policy_chosen, policy_rejected, reference_chosen, reference_rejected, *, beta: float, loss_type: str = "sigmoid",
        label_smoothing: float = 0.0, chosen_tokens=None, rejected_tokens=None) -> ExampleLosses:
    chosen_ratio = policy_chosen - reference_chosen
    rejected_ratio = policy_rejected - reference_rejected
    h = chosen_ratio - rejected_ratio
    eps = label_smoothing
    if loss_type == "sigmoid":
        losses = -(1 - eps) * F.logsigmoid(beta * h) - eps * F.logsigmoid(-beta * h)
    elif loss_type == "robust":
        losses = (-(1 - eps) * F.logsigmoid(beta * h) + eps * F.logsigmoid(-beta * h)) / (1 - 2 * eps)
    elif loss_type == "hinge":
        losses = torch.relu(1 - beta * h)
    elif loss_type == "ipo":
        mean_h = chosen_ratio / chosen_tokens.clamp(min=1) - rejected_ratio / rejected_tokens.clamp(min=1)
        losses = (mean_h - 1 / (2 * beta)) ** 2
    else:
        raise ValueError(f"unknown DPO loss type {loss_type!r}")
    return ExampleLosses(losses, beta * chosen_ratio.detach(), beta * rejected_ratio.detach())


def simpo(policy_chosen, policy_rejected, *, chosen_tokens, rejected_tokens, beta: float, gamma: float,
          label_smoothing: float = 0.0) -> ExampleLosses:
    chosen_mean = policy_chosen / chosen_tokens.clamp(min=1)
    rejected_mean = policy_rejected / rejected_tokens.clamp(min=1)
    margin = beta * (chosen_mean - rejected_mean) - gamma
    eps = label_smoothing
    losses = -(1 - eps) * F.logsigmoid(margin) - eps * F.logsigmoid(-margin)
    return ExampleLosses(losses, beta * chosen_mean.detach(), beta * rejected_mean.detach())


def log1mexp(x: torch.Tensor) -> torch.Tensor:
    """log(1 − exp(x)) for x < 0 without cancellation (Mächler 2012: switch at −ln 2)."""
    return torch.where(x < _LN_HALF, torch.log1p(-torch.exp(x)), torch.log(-torch.expm1(x)))


def orpo(policy_chosen, policy_rejected, *, chosen_tokens, rejected_tokens, orpo_lambda: float) -> ExampleLosses:
    chosen_mean = policy_chosen / chosen_tokens.clamp(min=1)
    rejected_mean = policy_rejected / rejected_tokens.clamp(min=1)
    log_odds = (chosen_mean - rejected_mean) - (log1mexp(chosen_mean) - log1mexp(rejected_mean))
    losses = -chosen_mean - orpo_lambda * F.logsigmoid(log_odds)
    return ExampleLosses(losses, orpo_lambda * chosen_mean.detach(), orpo_lambda * rejected_mean.detach())


def kto(policy, reference, desirable, kl, *, beta: float, desirable_weight: float = 1.0,
        undesirable_weight: float = 1.0) -> ExampleLosses:
    """``desirable``: bool per example; ``kl``: the batch's detached KL estimate (already clamped at 0)."""
    ratio = policy - reference
    losses = torch.where(
        desirable,
        desirable_weight * (1 - torch.sigmoid(beta * (ratio - kl))),
        undesirable_weight * (1 - torch.sigmoid(beta * (kl - ratio))),
    )
    return ExampleLosses(losses, beta * ratio.detach())


def sft_term(policy, tokens) -> torch.Tensor:
    """The mean token NLL of each answer (the SFT loss of one example)."""
    return -policy / tokens.clamp(min=1)
