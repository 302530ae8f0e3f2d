"""Preference objectives: DPO (sigmoid, IPO, hinge, robust), SimPO and ORPO on pairs; KTO on labelled answers.

A step's loss is the mean over the global batch's examples (pairs, or KTO examples) of the per-example
losses of :mod:`ftctl.objectives.losses`, so, as for SFT, the result does not depend on how the batch
is split over micro-batches and ranks. Each micro-batch is one forward of its sequences (a pair's two
answers side by side, padded or packed); DPO and KTO first score the same sequences with the reference
(:mod:`ftctl.objectives.reference`) unless their log-probs were precomputed.

Metrics, summed on the device and reduced over ranks in the step's one reduction (an eval pass: once at its end): ``rewards/chosen``,
``rewards/rejected`` (the mean implicit reward of each side), ``rewards/margins`` (their difference),
``rewards/accuracies`` (the share of pairs whose chosen reward is the higher; KTO: the share of examples
whose reward has the sign of their label), ``logps/chosen``, ``logps/rejected`` (mean summed log-probs
under the policy), ``truncated_share`` (examples with an answer cut to fit), and KTO's ``kl`` estimate.
"""

from __future__ import annotations

import logging
from typing import Optional

import torch

from ftctl.config.schema import REFERENCE_OBJECTIVES
from ftctl.data.preference import PAIRS, UNPAIRED, PreferenceBatching, build_preference_datasets, build_preference_eval_sets
from ftctl.objectives import losses
from ftctl.objectives.base import Objective, ObjectiveSetup, Tally
from ftctl.objectives.logprobs import sequence_logps, sequence_loss
from ftctl.objectives.reference import (
    DisabledAdapter, FrozenCopy, Precomputed, Reference, UntrainedPolicy, attach_reference_logps,
)

log = logging.getLogger("ftctl")


class PreferenceObjective(Objective):
    """dpo, simpo and orpo on pairs; the base of KTO."""

    kind = PAIRS

    def __init__(self, cfg):
        super().__init__(cfg)
        self.name = cfg.objective.name
        self.settings = cfg.objective
        self.reference: Optional[Reference] = None
        self.precision = None

    def build_datasets(self, tokenizer, seed):
        return build_preference_datasets(self.cfg.data, tokenizer, seed, self.kind)

    def build_eval_sets(self, tokenizer):
        return build_preference_eval_sets(self.cfg.data, tokenizer, self.kind)

    def batching(self, pad_token_id):
        return PreferenceBatching.from_config(self.cfg, pad_token_id)

    def units(self, batch):
        return batch.examples

    def prepare(self, setup: ObjectiveSetup) -> None:
        self.precision = setup.precision
        if self.name not in REFERENCE_OBJECTIVES:
            return
        if self.settings.precompute_reference:
            attach_reference_logps(setup.datasets, cfg=self.cfg, model_path=setup.model_path, precision=setup.precision,
                                   backend=setup.backend, make_batches=setup.make_batches,
                                   reference_factory=lambda: self._live_reference(setup, precomputing=True))
            self.reference = Precomputed()
        else:
            self.reference = self._live_reference(setup, precomputing=False)
        if setup.backend.is_main:
            log.info("objective=%s: reference log-probs from %s", self.name, self.reference.kind)

    def _live_reference(self, setup: ObjectiveSetup, precomputing: bool) -> Reference:
        if setup.method.name != "full" and not self.cfg.model.adapter:
            return DisabledAdapter(setup.engine.module, setup.model)
        if precomputing and not setup.resumed:
            return UntrainedPolicy(setup.engine.module)
        return FrozenCopy.load(setup.method, setup.model_path, setup.precision, setup.backend.device, self.cfg.data.packing,
                               self.cfg.train.kernels)

    def _reference_logps(self, batch, device) -> Optional[torch.Tensor]:
        return self.reference.sequence_logps(batch, device) if self.reference is not None else None

    # ------------------------------------------------------------------------------------------
    # pairs: dpo, simpo, orpo

    def example_losses(self, logps, reference, tokens) -> losses.ExampleLosses:
        o = self.settings
        chosen, rejected, chosen_tokens, rejected_tokens = logps[0::2], logps[1::2], tokens[0::2], tokens[1::2]
        if self.name == "dpo":
            return losses.dpo(chosen, rejected, reference[0::2], reference[1::2], beta=o.beta, loss_type=o.loss_type,
                              label_smoothing=o.label_smoothing, chosen_tokens=chosen_tokens, rejected_tokens=rejected_tokens)
        if self.name == "simpo":
            return losses.simpo(chosen, rejected, chosen_tokens=chosen_tokens, rejected_tokens=rejected_tokens, beta=o.beta,
                                gamma=o.gamma, label_smoothing=o.label_smoothing)
        return losses.orpo(chosen, rejected, chosen_tokens=chosen_tokens, rejected_tokens=rejected_tokens, orpo_lambda=o.orpo_lambda)

    def loss_sum(self, module, batch, device, tally=None):
        reference = self._reference_logps(batch, device)
        tokens = batch.sequence_tokens.to(device, non_blocking=True)
        found = {}

        def loss_fn(logps: torch.Tensor) -> torch.Tensor:
            out = found["out"] = self.example_losses(logps, reference, tokens)
            per_example = out.losses
            if self.settings.sft_weight:
                per_example = per_example + self.settings.sft_weight * losses.sft_term(logps[0::2], tokens[0::2])
            return per_example.sum()

        loss, logps = sequence_loss(module, batch, device, loss_fn)
        out = found["out"]
        chosen, rejected = out.chosen_rewards, out.rejected_rewards
        if tally is not None:
            tally.add(torch.stack([chosen.sum(), rejected.sum(), (chosen - rejected).sum(), (chosen > rejected).sum(),
                                   logps[0::2].sum(), logps[1::2].sum()]), batch.examples, batch.truncated_examples)
        return loss

    def new_tally(self):
        return Tally(6, 2)

    def step_metrics(self, sums, prefix=""):
        *sums, examples, truncated = sums
        if not examples:
            return {}
        names = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen", "logps/rejected")
        metrics = {prefix + name: value / examples for name, value in zip(names, sums)}
        metrics[prefix + "truncated_share"] = truncated / examples
        return metrics


class KTO(PreferenceObjective):
    """KTO on labelled answers; the KL estimate z of a step is the mean over the whole global batch of its KL
    sequences' log-ratio (policy − reference), computed before the step's micro-batches, detached, clamped at 0."""

    kind = UNPAIRED

    def __init__(self, cfg):
        super().__init__(cfg)
        self._step_kl: Optional[torch.Tensor] = None

    def _kl_sums(self, module, batch, device) -> torch.Tensor:
        with torch.no_grad():
            ratio = sequence_logps(module, batch.kl, device) - self._reference_logps(batch.kl, device)
            return torch.stack([ratio.sum(), torch.tensor(float(batch.kl.num_sequences), device=ratio.device)])

    def begin_step(self, module, batches, backend):
        with self.precision.autocast():
            sums = sum(self._kl_sums(module, batch, backend.device) for batch in batches)
        sums = backend.all_reduce_sum(sums)
        self._step_kl = (sums[0] / sums[1]).clamp(min=0).float()

    def loss_sum(self, module, batch, device, tally=None):
        if module.training:
            kl = self._step_kl
        else:  # an eval pass: each micro-batch estimates its own KL (no collective per batch)
            sums = self._kl_sums(module, batch, device)
            kl = (sums[0] / sums[1]).clamp(min=0).float()
        o = self.settings
        reference = self._reference_logps(batch, device)
        tokens = batch.sequence_tokens.to(device, non_blocking=True)
        desirable = batch.desirable.to(device, non_blocking=True)
        found = {}

        def loss_fn(logps: torch.Tensor) -> torch.Tensor:
            out = found["out"] = losses.kto(logps, reference, desirable, kl, beta=o.beta, desirable_weight=o.desirable_weight,
                                            undesirable_weight=o.undesirable_weight)
            per_example = out.losses
            if o.sft_weight:
                per_example = per_example + o.sft_weight * torch.where(desirable, losses.sft_term(logps, tokens), 0.0)
            return per_example.sum()

        loss, logps = sequence_loss(module, batch, device, loss_fn)
        rewards = found["out"].chosen_rewards
        wanted, unwanted = desirable.double(), (~desirable).double()
        right_side = torch.where(desirable, rewards > 0, rewards < 0).double()
        if tally is not None:
            tally.add(torch.stack([(rewards * wanted).sum(), (rewards * unwanted).sum(), right_side.sum(), (logps * wanted).sum(),
                                   (logps * unwanted).sum(), wanted.sum(), kl.double()]), batch.examples, batch.truncated_examples, 1.0)
        return loss

    def new_tally(self):
        return Tally(7, 3)

    def step_metrics(self, sums, prefix=""):
        chosen_sum, rejected_sum, right, chosen_logps, rejected_logps, wanted, kl_sum, examples, truncated, batches = sums
        if not examples:
            return {}
        unwanted = examples - wanted
        metrics = {prefix + "rewards/accuracies": right / examples, prefix + "truncated_share": truncated / examples,
                   prefix + "kl": kl_sum / batches}
        if wanted:
            metrics[prefix + "rewards/chosen"] = chosen_sum / wanted
            metrics[prefix + "logps/chosen"] = chosen_logps / wanted
        if unwanted:
            metrics[prefix + "rewards/rejected"] = rejected_sum / unwanted
            metrics[prefix + "logps/rejected"] = rejected_logps / unwanted
        if wanted and unwanted:
            metrics[prefix + "rewards/margins"] = metrics[prefix + "rewards/chosen"] - metrics[prefix + "rewards/rejected"]
        return metrics
