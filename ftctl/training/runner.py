"""The one training loop. Method, backend, precision and objective are chosen by config; the loop does not branch on them.

Reading order: set up the process group and precision, tokenize the data the objective's way, build
the model the method's way, let the backend wrap it, let the objective prepare (a reference model),
then for each step: fetch this rank's share of the global batch, run its micro-batches with the loss
normalised by the global batch's units (trained tokens for SFT, examples for preference objectives),
take an optimizer step, log, evaluate, checkpoint. Finally save the result where HF tools load it.
"""

from __future__ import annotations

import logging
import random
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from ftctl.config.schema import RunConfig
from ftctl.config.validate import gradient_accumulation_steps
from ftctl.data.batching import sampler_for
from ftctl.errors import FtctlError
from ftctl.data.prefetch import StepBatches
from ftctl.data.template_tokens import add_template_tokens
from ftctl.methods import create_method
from ftctl.models.kernels import use_kernels
from ftctl.models.neftune import add_neftune_noise
from ftctl.models.loading import attention_for_run, load_tokenizer, resolve_model_path
from ftctl.models.packed_attention import use_packed_attention
from ftctl.objectives import create_objective
from ftctl.objectives.base import SFT, ObjectiveSetup
from ftctl.parallel.backends import create_backend
from ftctl.precision.policy import resolve_precision
from ftctl.training.checkpoint import save_checkpoint, save_result
from ftctl.training.divergence import DivergenceGuard, uniform_prediction_loss
from ftctl.training.evals import BestSoFar, RunEvals, write_weights
from ftctl.training.interrupts import NonFiniteGuard, StepOutcome, StopRequest, TrainingInterrupted
from ftctl.training.loss import returns_head_output
from ftctl.training.packing_check import check_packing
from ftctl.training.metrics import LogWindow, MetricsLogger
from ftctl.training.optimizers import build_optimizer, evaluation_weights, settle_final_weights
from ftctl.training.plot import plot_after_run
from ftctl.training.resume import flatten_keys, restore_training_state, resume_checkpoint
from ftctl.training.run_dir import announce_run_dir
from ftctl.training.schedule import learning_rate, total_steps
from ftctl.training.step_sync import StepSync
from ftctl.training.trackers import requested_trackers

log = logging.getLogger("ftctl")


@dataclass
class TrainResult:
    run_dir: Path
    final_dir: Path
    steps: int
    last_loss: float
    last_eval_loss: Optional[float]
    model: Optional[torch.nn.Module] = None  # the trained module, for callers that train in-process


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def train(cfg: RunConfig, run_dir: Path) -> TrainResult:
    backend = create_backend(cfg)
    threads = torch.get_num_threads()  # train.num_threads is this run's; a caller's process keeps its own
    try:
        return _train(cfg, Path(run_dir), backend)
    finally:
        backend.close()
        torch.set_num_threads(threads)


def _train(cfg: RunConfig, run_dir: Path, backend) -> TrainResult:
    t = cfg.train
    if t.num_threads:
        torch.set_num_threads(t.num_threads)
    seed_everything(cfg.seed)
    precision = resolve_precision(cfg.precision, backend.device)
    model_path = resolve_model_path(cfg.model.name_or_path)
    # One decision before anything loads, from the model's config: the attention it loads with and the packed
    # kernel; a kernel this machine or precision cannot run is a message, not a wasted model load.
    attention = attention_for_run(cfg, model_path, backend.device.type, precision.name)
    method = create_method(cfg, attention)
    objective = create_objective(cfg)
    tokenizer = load_tokenizer(cfg.model, model_path)
    # A named template's special tokens the tokenizer splits: a warning, or (data.add_special_tokens) new rows to train.
    method.new_token_ids = add_template_tokens(tokenizer, cfg.data.chat_template, cfg.data.add_special_tokens, say=backend.is_main)
    train_data, eval_data = objective.build_datasets(tokenizer, cfg.seed)
    evals = RunEvals(eval_data, objective.build_eval_sets(tokenizer), cfg.data, t.eval_every)
    _log_data(backend, train_data, eval_data, evals)
    steps = total_steps(t, len(train_data))
    if backend.is_main and t.epochs is not None:
        log.info("train.epochs=%g over %d train examples: %d steps of %d examples", t.epochs, len(train_data), steps, t.global_batch_size)

    model = method.build_model(model_path, precision, backend.build_device)
    kernels_used = use_kernels(model, t.kernels)
    if kernels_used and backend.is_main:
        log.info(kernels_used)
    returns_head_output(model)  # probed now, before any wrapper: decides the fused head loss (ftctl.training.loss)
    if cfg.data.packing:
        use_packed_attention(model, attention.packed_kernel)
        ran = check_packing(model, tokenizer.pad_token_id, precision.compute_dtype)
        if backend.is_main:
            log.info("packed attention: %s", attention.describe(ran))
    resume_from = resume_checkpoint(cfg, run_dir)
    if resume_from is not None:
        method.load_checkpoint_weights(model, resume_from)
    best = BestSoFar(t, run_dir, backend.is_main)
    best.restore(resume_from)
    if t.neftune_alpha:
        add_neftune_noise(model, t.neftune_alpha)
    counts = method.count_parameters(model)
    model = backend.parallelize(model)  # checkpointing and compile; a mesh's splits too, in their one order
    engine = backend.prepare(model, lambda m: build_optimizer(m, cfg, backend.device), precision)
    start_step = restore_training_state(resume_from, engine, backend) if resume_from is not None else 0
    if start_step >= steps:
        raise FtctlError(f"{resume_from} is at step {start_step} and this run has {steps} steps; raise "
                         f"train.{'epochs' if t.epochs is not None else 'max_steps'} to extend it")
    accumulation = gradient_accumulation_steps(cfg, backend.world_size)
    if backend.is_main:
        log.info(
            "method=%s parallel=%s×%d precision=%s | trainable %s of %s params | global batch %d = %d micro × %d ranks × %d accumulation",
            method.name, cfg.parallel.name, backend.world_size, precision.name, f"{counts['trainable']:,}",
            f"{counts['total']:,}", t.global_batch_size, t.micro_batch_size, backend.dp_size, accumulation,
        )

    sampler = sampler_for(train_data, t.global_batch_size, cfg.seed, cfg.data.shuffle)
    make_batches = objective.batching(tokenizer.pad_token_id)
    objective.prepare(ObjectiveSetup(method, model, engine, model_path, backend, precision, [("train", train_data), *evals.sets],
                                     make_batches, resumed=resume_from is not None))
    metrics = MetricsLogger(run_dir, steps, start_step, enabled=backend.is_main, trackers=requested_trackers(t),
                            params=flatten_keys(asdict(cfg)), progress_bar=t.progress_bar)
    window = LogWindow(backend.device, objective.step_metrics)
    nonfinite = NonFiniteGuard(t.max_nonfinite_steps, precision.needs_scaler, precision.name, t.lr)
    divergence = DivergenceGuard(t, uniform_prediction_loss(model), run_dir)
    outcome, eval_loss = None, None

    def checkpoint(step: int):
        with evaluation_weights(engine.optimizer):  # a checkpoint is a loadable result too
            return save_checkpoint(run_dir, step, backend=backend, engine=engine, method=method, model=model,
                                   tokenizer=tokenizer, extra={"loss": outcome.loss if outcome else None, "parallel": cfg.parallel.name, **best.state()},
                                   keep_last=t.keep_last, protect_before=divergence.suspect_since)

    def save_best(directory, info):
        with evaluation_weights(engine.optimizer):
            write_weights(directory, backend=backend, engine=engine, method=method, model=model, tokenizer=tokenizer, info=info)

    if backend.is_main:  # only now: a run that fails while loading leaves no run dir to announce
        announce_run_dir(run_dir)

    def step_share(step: int):
        return make_batches.step_share(train_data, sampler, step, backend.dp_rank, backend.dp_size)

    engine.module.train()
    upcoming = StepBatches(step_share, range(start_step, steps), pin_memory=backend.device.type == "cuda")
    with StopRequest() as stop, upcoming:
        try:
            for step, share in upcoming:
                lr = learning_rate(step, t, steps)
                engine.set_lr(lr)
                outcome = train_step(engine, share, backend, precision, t.max_grad_norm, stop.requested_here, objective)
                nonfinite.check(step + 1, outcome, keep_last_good=lambda: checkpoint(step) if step > 0 else None)
                window.add(outcome)
                done = step + 1
                metrics.advance()
                scores = evals.run(lambda data: evaluate(engine, data, make_batches, backend, precision, objective)) if evals.due(done, steps) else None
                stopping = scores is not None and best.observe(done, scores)
                if done % t.log_every == 0 or done == steps or stopping:
                    metrics.log(done, {**window.take(), "lr": lr, "grad_norm": outcome.grad_norm,
                                       "epoch": sampler.epoch(done), **engine.scaler_metrics()})
                if scores is not None:
                    metrics.log(done, scores)
                    eval_loss = next(iter(scores.values()))
                    best.act(done, save_best)  # best/ and the early-stopping line
                divergence.check(done, outcome.loss, outcome.grad_norm)  # logged first, never saved
                # Always at the end (and an early stop's end): every run can be resumed or extended (resume=auto).
                if done == steps or stopping or (t.save_every and done % t.save_every == 0):
                    checkpoint(done)
                if stopping:
                    break
                if outcome.stop_requested:
                    raise TrainingInterrupted(
                        f"{stop.signal_name} at step {done}: checkpoint saved to {checkpoint(done)}; continue with "
                        f"the same command plus resume=auto (output_dir={run_dir})"
                    )
        finally:
            metrics.close()
            if backend.is_main and t.plot:  # an interrupted run's curve too: it shows where it stopped
                plot_after_run(run_dir)

    final_dir = run_dir / "final"
    settle_final_weights(engine.optimizer)
    state = engine.gathered_state_dict()
    if backend.is_main:
        save_result(final_dir, lambda out: method.save(model, tokenizer, out, state_dict=method.trainable_state_dict(model, state)))
        log.info("saved %s result to %s (final loss %.4f)", method.name, final_dir, outcome.loss)
        if best.summary():
            log.info(best.summary())
    backend.barrier()
    return TrainResult(run_dir, final_dir, best.stopped_at or steps, outcome.loss, eval_loss, model)


def train_step(engine, share, backend, precision, max_grad_norm: float, stop_requested=lambda: False,
               objective=SFT()) -> StepOutcome:
    """One optimizer step over this rank's micro-batches; the loss is the global batch's mean over the objective's
    units (SFT: the mean token loss).

    Nothing in the micro-batch loop reads a device value back (on a GPU each read stalls the queue):
    the unit and token counts are host numbers and the loss (and the objective's metric sums) add up on
    the device. The step then reduces once across ranks and reads once (:class:`ftctl.training.step_sync.StepSync`).
    """
    # Normalise by the units of the whole global batch, so the update does not depend on how the batch
    # is split over micro-batches and ranks; every rank counted them before the step.
    global_units = share.global_units
    # Data-parallel backends average gradients over their data-parallel ranks; their number undoes that.
    scale = backend.dp_size / global_units if global_units else float("nan")
    batches = share.micro_batches
    objective.begin_step(engine.module, batches, backend)
    tally = objective.new_tally()
    loss_sum = engine.forward_backward(batches, micro_batch_loss(precision, backend.device, objective, tally), scale,
                                       backend.device)
    sync = StepSync(backend, loss_sum, batches, stop_requested, tally)
    result = engine.step(max_grad_norm, sync)
    totals = sync.totals
    if totals.trained_tokens != share.global_trained_tokens:
        raise RuntimeError(f"the ranks' micro-batches hold {totals.trained_tokens} trained tokens, "
                           f"the global batch {share.global_trained_tokens}")
    loss = totals.loss_sum / global_units if global_units else float("nan")
    return StepOutcome(loss, result.grad_norm, result.skipped, share.global_trained_tokens, totals.real_tokens, totals.positions,
                       totals.stop_requested, global_units, totals.objective_sums)


def micro_batch_loss(precision, device, objective=SFT(), tally=None):
    """One micro-batch's summed loss (the objective's; SFT: the token loss) under the run's autocast: what
    engines call per micro-batch. The objective adds its metric sums to ``tally`` on the device."""

    def loss_of(module, batch):
        with precision.autocast():
            return objective.loss_sum(module, batch, device, tally)

    return loss_of


@torch.no_grad()
def evaluate(engine, eval_data, make_batches, backend, precision, objective=SFT()):
    """(mean loss over the whole eval split, the objective's metrics on it); ranks take interleaved examples and sum."""
    with evaluation_weights(engine.optimizer):
        return _evaluate(engine, eval_data, make_batches, backend, precision, objective)


def _evaluate(engine, eval_data, make_batches, backend, precision, objective):
    engine.module.eval()
    indices = list(range(backend.dp_rank, len(eval_data), backend.dp_size))
    batches = make_batches(eval_data, indices)
    total = torch.zeros((), dtype=torch.float64, device=backend.device)  # summed on the device: no read per batch
    units = float(sum(objective.units(batch) for batch in batches))
    tally = objective.new_tally()
    if batches:
        total += engine.eval_loss_sum(batches, micro_batch_loss(precision, backend.device, objective, tally))
    engine.module.train()
    # One reduction: the loss, the units and the objective's metric sums.
    sums = backend.all_reduce_sum(torch.cat([torch.stack([total.cpu(), torch.tensor(units, dtype=torch.float64)]),
                                             tally.local_sums() if tally is not None else torch.zeros(0, dtype=torch.float64)])).tolist()
    loss = sums[0] / max(sums[1], 1.0)
    return loss, (objective.step_metrics(sums[2:]) if tally is not None else {})


def _log_data(backend, train_data, eval_data, evals: RunEvals) -> None:
    if not backend.is_main:
        return
    if evals.eval_every and not evals:
        log.warning("train.eval_every=%d, but there is no eval data (data.eval_path, data.eval_fraction or data.eval_sets): "
                    "no eval runs", evals.eval_every)
    s = train_data.stats
    log.info(
        "data: %d train examples (%d trained tokens), %d eval%s; %d truncated to max_seq_len, %d dropped with no trained token; cache %s",
        len(train_data), train_data.trained_tokens(), len(eval_data) if eval_data is not None else 0,
        "".join(f", {n} in eval set {name}" for name, n in evals.named_sizes.items()),
        s.get("truncated", 0), s.get("dropped_no_trained_tokens", 0), s.get("cache", "-"),
    )
    from ftctl.data.dataset import format_summary, mixture_summary

    if s.get("mixture"):
        log.info("data mixture, each epoch's share: %s", mixture_summary(s))
    for data in [train_data, *(data for _, data in evals.sets)]:  # eval_data is evals' first set
        if data.stats.get("format"):
            log.info("data format: %s", format_summary(data.stats))
