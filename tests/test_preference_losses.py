"""Each preference loss of ftctl.objectives.losses against an independent reference, in value and gradient.

The reference is TRL's own loss code, run on the very same per-token log-probabilities: DPOTrainer's
and KTOTrainer's ``_compute_loss`` (with a stand-in trainer whose "model" returns those log-probs,
precomputed reference log-probs and pass-through gathers), CPOTrainer's ``cpo_loss`` for SimPO and
ORPOTrainer's ``odds_ratio_loss`` for ORPO's odds-ratio term. Where TRL differs from the paper (its
sigmoid DPO has no label smoothing; ORPO's NLL is over prompt and answer), the formula is written out
from the paper here.
"""

from __future__ import annotations

import collections
import math
import types

import pytest
import torch
import torch.nn.functional as F

from ftctl.objectives import losses

PAIRS, WIDTH = 3, 7
LENGTHS = [3, 5, 2, 4, 6, 1]  # answer tokens of chosen 0-2, then rejected 0-2 (TRL's [chosen; rejected] layout)


def stand_in_trainer(**settings):
    accelerator = types.SimpleNamespace(device=torch.device("cpu"), gather=lambda x: x, gather_for_metrics=lambda x: x,
                                        unwrap_model=lambda m: m)
    base = dict(model=types.SimpleNamespace(training=True), accelerator=accelerator, aux_loss_enabled=False, ld_alpha=None,
                precompute_ref_logps=True, f_divergence_type="reverse_kl", loss_weights=[1.0], use_weighting=False,
                _metrics=collections.defaultdict(lambda: collections.defaultdict(list)), _total_train_tokens=0, _tp_size=1,
                label_smoothing=0.0, calculate_KL=True, alpha=0.0)
    base.update(settings)
    return types.SimpleNamespace(**base)


def token_logps(rows: int, seed: int):
    """(per-token log-probs leaf, completion mask, its shifted form): answers right-aligned, as TRL lays them out."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(rows, WIDTH, dtype=torch.long)
    for i, n in enumerate(LENGTHS[:rows]):
        mask[i, WIDTH - n:] = 1
    tokens = (-torch.rand(rows, WIDTH - 1, generator=g) * 3).requires_grad_()
    return tokens, mask, mask[:, 1:]


def model_returning(per_token_logps):
    rows, positions = per_token_logps.shape
    out = types.SimpleNamespace(log_probs=per_token_logps, entropy=torch.zeros(rows, positions),
                                mean_logits=torch.zeros(rows, positions), is_top1=torch.zeros(rows, positions, dtype=torch.bool))
    return lambda **kwargs: out


def gradient(loss, leaf):
    return torch.autograd.grad(loss, leaf, retain_graph=True)[0]


@pytest.fixture(scope="module")
def trl_trainers():
    pytest.importorskip("trl", reason="TRL is the reference implementation (installed by the test extra)")
    from trl.experimental.cpo.cpo_trainer import CPOTrainer
    from trl.experimental.orpo.orpo_trainer import ORPOTrainer
    from trl.trainer.dpo_trainer import DPOTrainer
    from trl.trainer.kto_trainer import KTOTrainer

    return types.SimpleNamespace(dpo=DPOTrainer, kto=KTOTrainer, cpo=CPOTrainer, orpo=ORPOTrainer)


@pytest.mark.parametrize("loss_type, label_smoothing", [("sigmoid", 0.0), ("ipo", 0.0), ("hinge", 0.0), ("robust", 0.2)])
def test_dpo_losses_equal_trls(trl_trainers, loss_type, label_smoothing):
    tokens, mask, shifted = token_logps(2 * PAIRS, seed=1)
    reference = -torch.rand(2 * PAIRS, generator=torch.Generator().manual_seed(2)) * 8
    inputs = {"input_ids": torch.zeros(2 * PAIRS, WIDTH, dtype=torch.long), "attention_mask": torch.ones(2 * PAIRS, WIDTH, dtype=torch.long),
              "completion_mask": mask, "ref_chosen_logps": reference[:PAIRS], "ref_rejected_logps": reference[PAIRS:]}
    trainer = stand_in_trainer(beta=0.3, loss_types=[loss_type], label_smoothing=label_smoothing)
    theirs = trl_trainers.dpo._compute_loss(trainer, model_returning(tokens * shifted), inputs, False)

    sums, counts = (tokens * shifted).sum(1), shifted.sum(1).float()
    mine = losses.dpo(sums[:PAIRS], sums[PAIRS:], reference[:PAIRS], reference[PAIRS:], beta=0.3, loss_type=loss_type,
                      label_smoothing=label_smoothing, chosen_tokens=counts[:PAIRS], rejected_tokens=counts[PAIRS:])
    ours = mine.losses.mean()
    torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(gradient(ours, tokens), gradient(theirs, tokens), rtol=1e-6, atol=1e-8)
    metrics = trainer._metrics["train"]
    assert metrics["rewards/chosen"][-1] == pytest.approx(float(mine.chosen_rewards.mean()), rel=1e-6)
    assert metrics["rewards/margins"][-1] == pytest.approx(float((mine.chosen_rewards - mine.rejected_rewards).mean()), rel=1e-6)


def test_conservative_dpo_is_the_papers_formula():
    """TRL's sigmoid loss has no label smoothing; cDPO (Mitchell 2023) mixes in the flipped pair's loss with weight ε."""
    g = torch.Generator().manual_seed(3)
    draw = lambda: -torch.rand(4, generator=g, dtype=torch.float64) * 20  # noqa: E731  float64: the naive formula loses digits
    chosen, rejected, ref_chosen, ref_rejected = draw().requires_grad_(), draw().requires_grad_(), draw(), draw()
    beta, eps = 0.5, 0.1
    h = (chosen - ref_chosen) - (rejected - ref_rejected)
    sig = torch.sigmoid(beta * h)
    paper = -(1 - eps) * torch.log(sig) - eps * torch.log(1 - sig)
    ours = losses.dpo(chosen, rejected, ref_chosen, ref_rejected, beta=beta, label_smoothing=eps).losses
    torch.testing.assert_close(ours, paper, rtol=1e-10, atol=1e-12)
    torch.testing.assert_close(gradient(ours.sum(), chosen), gradient(paper.sum(), chosen), rtol=1e-10, atol=1e-12)


@pytest.mark.parametrize("label_smoothing", [0.0, 0.15])
def test_simpo_equals_trls_cpo_loss(trl_trainers, label_smoothing):
    tokens, _, shifted = token_logps(2 * PAIRS, seed=4)
    sums, counts = (tokens * shifted).sum(1), shifted.sum(1).float()
    means = sums / counts  # CPOTrainer scores SimPO with the average log-probability of each answer
    trainer = stand_in_trainer(beta=2.0, simpo_gamma=1.2, loss_type="simpo", label_smoothing=label_smoothing)
    theirs, their_chosen, their_rejected = trl_trainers.cpo.cpo_loss(trainer, means[:PAIRS], means[PAIRS:])
    mine = losses.simpo(sums[:PAIRS], sums[PAIRS:], chosen_tokens=counts[:PAIRS], rejected_tokens=counts[PAIRS:], beta=2.0,
                        gamma=1.2, label_smoothing=label_smoothing)
    torch.testing.assert_close(mine.losses, theirs, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(gradient(mine.losses.sum(), tokens), gradient(theirs.sum(), tokens), rtol=1e-6, atol=1e-8)
    torch.testing.assert_close(mine.chosen_rewards, their_chosen)
    torch.testing.assert_close(mine.rejected_rewards, their_rejected)


def test_orpo_odds_ratio_equals_trls_and_nll_is_the_papers(trl_trainers):
    tokens, _, shifted = token_logps(2 * PAIRS, seed=5)
    tokens = (tokens * 0.3).detach().requires_grad_()  # mean probabilities well inside (0, 1), both branches of log1mexp
    sums, counts = (tokens * shifted).sum(1), shifted.sum(1).float()
    means = sums / counts
    trainer = stand_in_trainer(beta=0.25)
    their_terms, *_ = trl_trainers.orpo.odds_ratio_loss(trainer, means[:PAIRS], means[PAIRS:])
    # ORPO (Hong et al. 2024, eq. 6): L = L_SFT + λ·L_OR, L_SFT the mean token NLL of the chosen answer, L_OR = −log σ(log OR).
    theirs = -means[:PAIRS] - their_terms
    mine = losses.orpo(sums[:PAIRS], sums[PAIRS:], chosen_tokens=counts[:PAIRS], rejected_tokens=counts[PAIRS:], orpo_lambda=0.25)
    torch.testing.assert_close(mine.losses, theirs, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(gradient(mine.losses.sum(), tokens), gradient(theirs.sum(), tokens), rtol=1e-6, atol=1e-8)
    # The odds, written out: P/(1-P) with P the mean token probability.
    p_chosen, p_rejected = means[:PAIRS].exp(), means[PAIRS:].exp()
    log_odds = torch.log(p_chosen / (1 - p_chosen)) - torch.log(p_rejected / (1 - p_rejected))
    torch.testing.assert_close(mine.losses, -means[:PAIRS] - 0.25 * F.logsigmoid(log_odds), rtol=1e-5, atol=1e-6)


def test_kto_equals_trls(trl_trainers):
    rows = 6
    tokens, mask, shifted = token_logps(rows, seed=6)
    g = torch.Generator().manual_seed(7)
    reference = -torch.rand(rows, generator=g) * 8
    kl_policy, kl_reference = -torch.rand(rows, generator=g) * 8, -torch.rand(rows, generator=g) * 8
    labels = torch.tensor([True, False, True, True, False, False])
    inputs = {"input_ids": torch.zeros(rows, WIDTH, dtype=torch.long), "attention_mask": torch.ones(rows, WIDTH, dtype=torch.long),
              "completion_mask": mask, "label": labels, "ref_logps": reference, "ref_KL_logps": kl_reference}
    trainer = stand_in_trainer(beta=0.4, loss_type="kto", desirable_weight=1.5, undesirable_weight=0.7,
                               _compute_kl_logps=lambda model, batch: kl_policy)
    theirs = trl_trainers.kto._compute_loss(trainer, model_returning(tokens * shifted), inputs, False)
    kl = (kl_policy - kl_reference).mean().clamp(min=0)
    mine = losses.kto((tokens * shifted).sum(1), reference, labels, kl, beta=0.4, desirable_weight=1.5, undesirable_weight=0.7)
    torch.testing.assert_close(mine.losses.mean(), theirs, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(gradient(mine.losses.mean(), tokens), gradient(theirs, tokens), rtol=1e-6, atol=1e-8)
    assert trainer._metrics["train"]["kl"][-1] == pytest.approx(float(kl), rel=1e-6)


def test_the_kto_reference_is_the_papers_formula_with_a_positive_kl():
    """KTO (Ethayarajh et al. 2024, eq. 7) with z > 0, which the TRL check above may not reach."""
    ratio = torch.tensor([0.5, -1.0, 2.0])
    desirable = torch.tensor([True, False, False])
    z = torch.tensor(0.3)
    ours = losses.kto(ratio, torch.zeros(3), desirable, z, beta=2.0, desirable_weight=1.0, undesirable_weight=2.0).losses
    expected = [1 - 1 / (1 + math.exp(-2.0 * (0.5 - 0.3))), 2 * (1 - 1 / (1 + math.exp(-2.0 * (0.3 + 1.0)))),
                2 * (1 - 1 / (1 + math.exp(-2.0 * (0.3 - 2.0))))]
    torch.testing.assert_close(ours, torch.tensor(expected))
