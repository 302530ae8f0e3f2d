"""The one training loop. Method, backend and precision are chosen by config; the loop does not branch on them.

Reading order: set up the process group and precision, tokenize the data, build the model the
method's way, let the backend wrap it, then for each step: fetch this rank's share of the global
batch, run its micro-batches with the loss normalised by the global batch's trained tokens, take
an optimizer step, log, evaluate, checkpoint. Finally save the result where HF tools load it.
"""

from __future__ import annotations

import logging
import random
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from ftctl.config.schema import RunConfig
from ftctl.config.validate import gradient_accumulation_steps
from ftctl.data.batching import Batching, StepSampler
from ftctl.data.dataset import build_datasets
from ftctl.methods import create_method
from ftctl.models.loading import load_tokenizer, resolve_model_path
from ftctl.parallel import create_backend
from ftctl.precision import resolve_precision
from ftctl.training.checkpoint import save_checkpoint
from ftctl.training.interrupts import NonFiniteTraining, StopRequest, TrainingInterrupted
from ftctl.training.loss import token_loss_sum
from ftctl.training.metrics import MetricsLogger
from ftctl.training.optimizers import build_optimizer
from ftctl.training.resume import restore_training_state, resume_checkpoint
from ftctl.training.schedule import learning_rate

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
    try:
        return _train(cfg, Path(run_dir), backend)
    finally:
        backend.close()


def _train(cfg: RunConfig, run_dir: Path, backend) -> TrainResult:
    t = cfg.train
    if t.num_threads:
        torch.set_num_threads(t.num_threads)
    seed_everything(cfg.seed)
    precision = resolve_precision(cfg.precision, backend.device)
    method = create_method(cfg)

    model_path = resolve_model_path(cfg.model.name_or_path)
    tokenizer = load_tokenizer(cfg.model, model_path)
    train_data, eval_data = build_datasets(cfg.data, tokenizer, cfg.seed)
    _log_data(backend, train_data, eval_data)

    model = method.build_model(model_path, precision, backend.build_device)
    resume_from = resume_checkpoint(cfg, run_dir)
    if resume_from is not None:
        method.load_checkpoint_weights(model, resume_from)
    if t.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    counts = method.count_parameters(model)
    engine = backend.prepare(model, lambda m: build_optimizer(m, cfg, backend.device), precision)
    start_step = restore_training_state(resume_from, engine, backend) if resume_from is not None else 0
    accumulation = gradient_accumulation_steps(cfg, backend.world_size)
    if backend.is_main:
        log.info(
            "method=%s parallel=%s×%d precision=%s | trainable %s of %s params | global batch %d = %d micro × %d ranks × %d accumulation",
            method.name, cfg.parallel.name, backend.world_size, precision.name, f"{counts['trainable']:,}",
            f"{counts['total']:,}", t.global_batch_size, t.micro_batch_size, backend.world_size, accumulation,
        )

    sampler = StepSampler(len(train_data), t.global_batch_size, cfg.seed, cfg.data.shuffle)
    metrics = MetricsLogger(run_dir, t.max_steps, start_step, enabled=backend.is_main, tensorboard=t.tensorboard, progress_bar=t.progress_bar)
    pad_id = tokenizer.pad_token_id
    loss_value, eval_loss, skipped_steps, nonfinite_steps = float("nan"), None, 0, 0
    checkpoint = lambda step: save_checkpoint(  # noqa: E731
        run_dir, step, backend=backend, engine=engine, method=method, model=model, tokenizer=tokenizer,
        extra={"loss": loss_value}, keep_last=t.keep_last,
    )
    make_batches = Batching.from_config(cfg, pad_id)
    # real tokens, trained tokens, computed positions (padding included) since the last metrics line
    window_counts, window_start = torch.zeros(3, dtype=torch.float64), time.perf_counter()
    engine.module.train()
    stop = StopRequest().__enter__()
    try:
        for step in range(start_step, t.max_steps):
            lr = learning_rate(step, t)
            engine.set_lr(lr)
            indices = sampler.rank_share(step, backend.rank, backend.world_size)
            batches = make_batches(train_data, indices)
            # Normalise by the trained tokens of the whole global batch, so the update does not depend
            # on how the batch is split over micro-batches and ranks.
            global_tokens = backend.all_reduce_sum(torch.tensor(float(sum(b.trained_tokens for b in batches))))
            loss_sum = torch.zeros((), dtype=torch.float64)
            for i, batch in enumerate(batches):
                with engine.accumulating(last_micro_batch=i == len(batches) - 1):
                    with precision.autocast():
                        micro_loss = token_loss_sum(engine.module, batch, backend.device)
                    # Data-parallel backends average gradients over ranks; the world size undoes that.
                    engine.backward(micro_loss * backend.world_size / global_tokens.to(micro_loss.device))
                loss_sum += micro_loss.detach().double().cpu()
            result = engine.step(t.max_grad_norm)
            skipped_steps += result.skipped
            loss_value = float(backend.all_reduce_sum(loss_sum) / global_tokens)
            if not np.isfinite(loss_value) or (not precision.needs_scaler and not np.isfinite(result.grad_norm)):
                # The engine never applies a non-finite update, so the weights are still the last good ones.
                nonfinite_steps += 1
                if nonfinite_steps > t.max_nonfinite_steps:
                    kept = checkpoint(step) if step > 0 else None
                    raise NonFiniteTraining(step + 1, loss_value, result.grad_norm, kept)
                log.warning("step %d: non-finite loss or gradients; update skipped (%d of %d allowed)",
                            step + 1, nonfinite_steps, t.max_nonfinite_steps)
            real, positions = backend.all_reduce_sum(
                torch.tensor([sum(b.real_tokens for b in batches), sum(b.positions for b in batches)], dtype=torch.float64)
            ).tolist()
            window_counts += torch.tensor([real, float(global_tokens), positions], dtype=torch.float64)
            done = step + 1
            metrics.advance()
            if done % t.log_every == 0 or done == t.max_steps:
                elapsed = time.perf_counter() - window_start
                entry = {
                    "loss": loss_value,
                    "lr": lr,
                    "grad_norm": result.grad_norm,
                    "tokens_per_s": float(window_counts[0]) / max(elapsed, 1e-9),
                    "trained_tokens_per_s": float(window_counts[1]) / max(elapsed, 1e-9),
                    # Shares of the computed positions: padding, and everything without a trained label.
                    "padding_waste": 1.0 - float(window_counts[0] / window_counts[2]),
                    "non_trained_share": 1.0 - float(window_counts[1] / window_counts[2]),
                    "trained_tokens": int(global_tokens),
                    "epoch": sampler.epoch(done),
                }
                if precision.needs_scaler:
                    entry.update(loss_scale=engine.loss_scale(), skipped_steps=skipped_steps)
                metrics.log(done, entry)
                window_counts, window_start = torch.zeros(3, dtype=torch.float64), time.perf_counter()
            if eval_data is not None and ((t.eval_every and done % t.eval_every == 0) or done == t.max_steps):
                eval_loss = evaluate(engine, eval_data, cfg, backend, precision, pad_id)
                metrics.log(done, {"eval_loss": eval_loss})
            if t.save_every and done % t.save_every == 0 and done < t.max_steps:
                checkpoint(done)
            if stop.requested(backend):
                kept = checkpoint(done)
                raise TrainingInterrupted(
                    f"{stop.signal_name} at step {done}: checkpoint saved to {kept}; continue with the same command "
                    f"plus resume=auto (output_dir={run_dir})"
                )
    finally:
        metrics.close()
        stop.__exit__()

    final_dir = run_dir / "final"
    state = engine.gathered_state_dict()
    if backend.is_main:
        method.save(model, tokenizer, final_dir, state_dict=method.trainable_state_dict(model, state))
        log.info("saved %s result to %s (final loss %.4f)", method.name, final_dir, loss_value)
    backend.barrier()
    return TrainResult(run_dir, final_dir, t.max_steps, loss_value, eval_loss, model)


@torch.no_grad()
def evaluate(engine, eval_data, cfg: RunConfig, backend, precision, pad_id: int) -> float:
    """Mean token loss over the whole eval split; ranks take interleaved examples and sum."""
    engine.module.eval()
    indices = list(range(backend.rank, len(eval_data), backend.world_size))
    total, tokens = torch.zeros((), dtype=torch.float64), torch.zeros((), dtype=torch.float64)
    for batch in Batching.from_config(cfg, pad_id)(eval_data, indices):
        with precision.autocast():
            total += token_loss_sum(engine.module, batch, backend.device).double().cpu()
        tokens += batch.trained_tokens
    engine.module.train()
    return float(backend.all_reduce_sum(total) / backend.all_reduce_sum(tokens).clamp(min=1))


def _log_data(backend, train_data, eval_data) -> None:
    if not backend.is_main:
        return
    s = train_data.stats
    log.info(
        "data: %d train examples (%d trained tokens), %d eval; %d truncated to max_seq_len, %d dropped with no trained token; cache %s",
        len(train_data), train_data.trained_tokens(), len(eval_data) if eval_data is not None else 0,
        s.get("truncated", 0), s.get("dropped_no_trained_tokens", 0), s.get("cache", "-"),
    )
