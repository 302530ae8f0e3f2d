"""Test-only worker: one torchrun launch runs many trainings in sequence and records what each backend did.

Run as ``python -m torch.distributed.run --nproc-per-node N tests/distributed_harness.py PLAN.json OUT_DIR``
(tests call :func:`launch`, which does that).
PLAN.json is a list of jobs ``{"id", "overrides", "overflow_at_forward"?, "stop_after_step"?, "cli"?}``. Every rank trains
each job through the real runner (``ftctl.training.runner.train``) or, for ``"cli"`` jobs, through
``ftctl train`` running in place under the launcher. The engine the backend built is kept, and after
training each rank measures what it really holds: how many elements of the trainable parameters,
of their gradients and of the optimizer state live on this rank, whether they are DTensor shards,
ZeRO-3 partitions, and in which dtype. Rank 0 writes OUT_DIR/evidence.json, which the tests read.
Sharing one launch keeps the suite fast: starting Python with torch, transformers and DeepSpeed
costs more than a tiny model's training.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
import traceback
from pathlib import Path
from typing import Optional

import torch


class PoisonGradient(torch.autograd.Function):
    """Identity forward; the gradient flowing back through it becomes inf, as an fp16 overflow would."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad * float("inf")


def install_overflow(model: torch.nn.Module, at_forward: int) -> None:
    """Poison the backward of the ``at_forward``-th forward call (0-based) of the first decoder layer."""
    from ftctl.parallel.fsdp import decoder_layers

    calls = {"n": 0}

    def hook(module, args, output):
        n = calls["n"]
        calls["n"] += 1
        if n != at_forward:
            return output
        if isinstance(output, tuple):
            return (PoisonGradient.apply(output[0]),) + tuple(output[1:])
        return PoisonGradient.apply(output)

    decoder_layers(model)[0].register_forward_hook(hook)


def local_numel(t: torch.Tensor) -> int:
    """Elements this rank stores: a DTensor's local shard, a ZeRO-3 parameter's partition, else all."""
    if hasattr(t, "ds_tensor"):
        return t.ds_tensor.numel()
    if hasattr(t, "to_local"):
        return t.to_local().numel()
    return t.numel()


def full_numel(t: torch.Tensor) -> int:
    return getattr(t, "ds_numel", None) or t.numel()


def expected_shard_rows(rows: int, rank: int, world: int) -> int:
    chunks = torch.arange(rows).chunk(world)
    return len(chunks[rank]) if rank < len(chunks) else 0


def record_compute_dtypes(model: torch.nn.Module, seen: set) -> None:
    """Record the output dtype of the first decoder layer's first linear layer: the precision the
    matmuls really ran in (bf16/fp16 under autocast or a backend's own mixed precision)."""
    from ftctl.parallel.fsdp import decoder_layers

    first_linear = next(m for m in decoder_layers(model)[0].modules() if isinstance(m, torch.nn.Linear))
    first_linear.register_forward_hook(lambda module, args, output: seen.add(str(output.dtype)))


class StopAfterSteps:
    """A StopRequest that asks to stop after ``steps`` steps, as a SIGTERM arriving then would."""

    def __init__(self, stop_request_class, steps: int):
        self.stop_request_class, self.steps = stop_request_class, steps

    def __call__(self):
        steps = self.steps

        class StopAfter(self.stop_request_class):
            checked = 0

            def requested_here(self):  # asked once per step, by the step's one reduction
                self.checked += 1
                if self.checked == steps:
                    self.signal_name = "SIGTERM"
                return super().requested_here()

        return StopAfter()


FULL_SIZE_STATES = ("exp_avg", "state1", "momentum_buffer", "z")


def measure(engine, model, rank: int, world: int, grad_numel_before_step, compute_dtypes=()) -> dict:
    trainable = [p for p in model.parameters() if p.requires_grad]
    frozen = [p for p in model.parameters() if not p.requires_grad]
    dtensor_shard0 = rows_as_expected = 0
    for p in trainable:
        placements = getattr(p, "placements", None)
        if placements is not None and len(placements) == 1 and placements[0].is_shard(0):
            dtensor_shard0 += 1
            rows_as_expected += p.to_local().shape[0] == expected_shard_rows(p.shape[0], rank, world)
    optimizer = getattr(engine.optimizer, "optimizer", engine.optimizer)  # DeepSpeed's ZeRO wraps torch's
    # The state each optimizer keeps as large as a parameter: AdamW's first moment, bitsandbytes' first
    # state, SGD's momentum, schedule-free's z (Adafactor keeps none: its statistics are factored).
    states = [next(s[k] for k in FULL_SIZE_STATES if k in s) for s in optimizer.state.values()
              if any(k in s for k in FULL_SIZE_STATES)]
    return {
        "module_type": type(engine.module).__name__,
        "trainable_full": sum(full_numel(p) for p in trainable),
        "trainable_local": sum(local_numel(p) for p in trainable),
        "frozen_full": sum(full_numel(p) for p in frozen),
        "frozen_local": sum(local_numel(p) for p in frozen),
        "trainable_count": len(trainable),
        "dtensor_shard0": dtensor_shard0,
        "shard_rows_as_expected": rows_as_expected,
        "released_params": sum(p.data.numel() == 0 for p in model.parameters()),  # ZeRO-3 frees gathered data
        "param_count": sum(1 for _ in model.parameters()),
        "optimizer_state_local": sum(local_numel(s) for s in states),
        "optimizer_state_dtypes": sorted({str(s.dtype) for s in states}),
        "trainable_dtypes": sorted({str(getattr(p, "ds_tensor", p).dtype) for p in trainable}),
        "grad_local_before_first_step": grad_numel_before_step,
        "compute_dtypes": sorted(compute_dtypes),
    }


def mesh_evidence(engine, model) -> dict:
    """What a parallel=mesh rank holds: each parameter's DTensor placements and mesh axes, the bytes of its
    local parameters next to their full size, the decoder layers of its stages, and its experts."""
    from torch.distributed.tensor import DTensor

    from ftctl.parallel.pipeline import decoder_layer_list

    backend = engine.backend
    placements, storages = {}, {}
    full_bytes = 0
    for name, p in model.named_parameters():
        full_bytes += p.numel() * p.element_size()
        if p.is_meta:  # held by another pipeline stage
            continue
        local = p.to_local() if isinstance(p, DTensor) else p
        placements[name] = ([repr(x) for x in p.placements], list(p.device_mesh.mesh_dim_names or ())) if isinstance(p, DTensor) else None
        storages[local.untyped_storage().data_ptr()] = local.untyped_storage().nbytes()
    _, layers = decoder_layer_list(model)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    held = lambda module: module is not None and not any(q.is_meta for q in module.parameters())  # noqa: E731
    return {
        "mesh": backend.shape.describe(), "coords": backend.coords, "placements": placements,
        "param_bytes_local": sum(storages.values()), "param_bytes_full": full_bytes,
        "layers": [i for i, layer in enumerate(layers) if held(layer)],
        "embeddings": held(base.get_input_embeddings()), "head": held(base.get_output_embeddings()),
        "experts": {name: [m.num_experts, m.gate_up_proj.to_local().shape[0] if hasattr(m.gate_up_proj, "to_local") else None]
                    for name, m in model.named_modules() if getattr(m, "_is_expert_parallel", False)},
    }


def run_job(job: dict, rank: int, world: int, common: list) -> dict:
    import torch.distributed as dist

    import ftctl.training.runner as runner
    from ftctl.cli import main as ftctl_main
    from ftctl.config.compose import compose_config
    from ftctl.training.run_dir import prepare_run_dir

    if job.get("cli"):
        return {"returncode": ftctl_main(["train", *common, *job["overrides"]])}

    from ftctl.training.interrupts import TrainingInterrupted

    seen = {"compute_dtypes": set()}
    create_backend = runner.create_backend
    stop_request = runner.StopRequest

    def recording_backend(cfg):
        backend = create_backend(cfg)
        prepare = backend.prepare

        def recording_prepare(model, make_optimizer, precision):
            if job.get("overflow_at_forward") is not None and rank == 0:
                install_overflow(model, job["overflow_at_forward"])
            record_compute_dtypes(model, seen["compute_dtypes"])
            engine = prepare(model, make_optimizer, precision)
            step = engine.step

            def recording_step(max_grad_norm, sync):
                if "grad" not in seen:  # what this rank holds of the gradients when the optimizer runs
                    seen["grad"] = sum(local_numel(p.grad) for p in model.parameters() if p.grad is not None)
                with counted_collectives() as calls:
                    result = step(max_grad_norm, sync)
                seen.setdefault("step_collectives", []).append(len(calls))
                return result

            engine.step = recording_step
            seen["engine"], seen["model"] = engine, model
            return engine

        backend.prepare = recording_prepare
        return backend

    cfg = compose_config([*common, *job["overrides"]])
    if rank == 0:
        prepare_run_dir(cfg)
    dist.barrier()
    memory = contextlib.ExitStack()
    if job.get("memory"):  # the process's memory increase from building the model to the end of training
        from memory_probe import training_memory

        marks = memory.enter_context(training_memory(runner, runner.MetricsLogger))
    runner.create_backend = recording_backend
    train_step = runner.train_step

    def recording_train_step(*args, **kwargs):  # torch.distributed's all-reduces of a whole step (TP's are functional)
        with counted_collectives() as calls:
            outcome = train_step(*args, **kwargs)
        seen.setdefault("step_all_reduces", []).append(calls.count("distributed.all_reduce"))
        return outcome

    runner.train_step = recording_train_step
    if job.get("stop_after_step"):
        runner.StopRequest = StopAfterSteps(stop_request, job["stop_after_step"])
    interrupted = False
    try:
        runner.train(cfg, Path(cfg.output_dir))
    except TrainingInterrupted:
        if not job.get("stop_after_step"):
            raise
        interrupted = True
    finally:
        runner.create_backend, runner.StopRequest, runner.train_step = create_backend, stop_request, train_step
        memory.close()
    record = {**measure(seen["engine"], seen["model"], rank, world, seen.get("grad"), seen["compute_dtypes"]),
              "rank": rank, "interrupted": interrupted}
    if hasattr(getattr(seen["engine"], "backend", None), "shape"):
        record["mesh"] = mesh_evidence(seen["engine"], seen["model"])
    if job.get("memory"):
        record["memory_increase"] = marks["peak"] - marks["before"]
    record["step_collectives"], record["step_all_reduces"] = seen.get("step_collectives", []), seen.get("step_all_reduces", [])
    return record


@contextlib.contextmanager
def counted_collectives():
    """The collectives called while active, as 'distributed.all_reduce' (torch.distributed's) or
    'functional_collectives.all_reduce' (those DTensors use)."""
    import torch.distributed as dist
    import torch.distributed._functional_collectives as funcol

    calls = []
    patched = [(module, name) for module, names in ((dist, ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor",
                                                             "all_gather_object", "broadcast", "send", "recv")),
                                                    (funcol, ("all_reduce", "all_gather_tensor", "reduce_scatter_tensor", "all_to_all_single")))
               for name in names if hasattr(module, name)]
    originals = [getattr(module, name) for module, name in patched]
    for (module, name), real in zip(patched, originals):
        label = f"{module.__name__.rsplit('.', 1)[-1].lstrip('_')}.{name}"
        setattr(module, name, lambda *a, _real=real, _name=label, **k: (calls.append(_name), _real(*a, **k))[1])
    try:
        yield calls
    finally:
        for (module, name), real in zip(patched, originals):
            setattr(module, name, real)


def launch(world: int, common: list, jobs: list, root: Path, timeout: int = 900, env: Optional[dict] = None) -> dict:
    """Run ``jobs`` in one torchrun launch of this file on ``world`` processes; the evidence by job id.

    Called by the tests (pytest fails on a failed launch or job)."""
    import pytest

    plan = root / "plan.json"
    plan.write_text(json.dumps({"common": common, "jobs": jobs}))
    env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", CUDA_VISIBLE_DEVICES="", **(env or {}))
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={world}",
               str(Path(__file__).resolve()), str(plan), str(root)]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    evidence_file = root / "evidence.json"
    if proc.returncode or not evidence_file.exists():
        pytest.fail(f"harness failed (exit {proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}")
    evidence = json.loads(evidence_file.read_text())
    failed = {k: v for k, v in evidence.items() if any("error" in r for r in v["ranks"])}
    if failed:
        pytest.fail(f"harness jobs failed: {json.dumps(failed, indent=1)[-6000:]}")
    return evidence


def main(plan_path: str, out_dir: str) -> int:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    plan = json.loads(Path(plan_path).read_text())
    evidence = {}
    for job in plan["jobs"]:
        start = time.perf_counter()
        try:
            record = run_job(job, rank, world, plan["common"])
        except Exception:
            traceback.print_exc()
            record = {"error": traceback.format_exc()}
        records = [None] * world
        dist.all_gather_object(records, record)
        evidence[job["id"]] = {"ranks": records, "seconds": round(time.perf_counter() - start, 2)}
        if any("error" in r for r in records):
            break  # a collective may be half done; the remaining jobs would hang or mislead
        if rank == 0:
            print(f"[harness] {job['id']}: {evidence[job['id']]['seconds']} s", flush=True)
    if rank == 0:
        Path(out_dir, "evidence.json").write_text(json.dumps(evidence, indent=1))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
