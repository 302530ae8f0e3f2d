"""Distributed backends × methods × precision on 2 CPU processes (gloo) with the tiny Llama.

One torchrun launch of tests/distributed_harness.py trains every distributed job below in sequence
and records, per rank, what the backend really holds (DTensor shards, ZeRO partitions, optimizer
state sizes, dtypes). The tests compare those runs with single-process references trained here:
with the same seed and data every backend must give the single-process loss curve (fp32, within
LOSS_RTOL relative) and the same final weights (within WEIGHT_ATOL). Two more launches go through
``ftctl train`` itself: one node with 2 workers started by ftctl, and 2 nodes × 1 process on
localhost with the flags a cluster uses.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from devices import cpu_only
from distributed_harness import launch
from ftctl.errors import ConfigError

pytestmark = pytest.mark.slow

BACKENDS = ("ddp", "fsdp", "zero1", "zero2", "zero3")
WORLD = 2
STEPS = 4
LOSS_RTOL = 1e-4  # fp32: max relative difference of any step's loss from the single-process run
# fp32: max absolute difference of any final weight. Weights are O(0.02-1) and each step moves them by
# up to lr = 3e-3; Adam divides by sqrt(v), so where a gradient is near zero the summation order alone
# (ranks, buckets, partitions) shifts the update by up to ~1% of a step: 2.6e-5 measured for ZeRO.
WEIGHT_ATOL = 1e-4
HARNESS_TIMEOUT = 900  # a guard against a hang; the launch takes 2-4 minutes on 2 idle cores
# DoRA runs also evaluate (every rank scores its share of the eval split); on the sharded backends the
# DoRA and QLoRA runs also recompute activations in backward. Neither changes the numbers.
EXTRA = {"dora": ["data.eval_fraction=0.125"], "fsdp": ["train.gradient_checkpointing=true"], "zero3": ["train.gradient_checkpointing=true"]}
HERE = Path(__file__).resolve().parent
#: The optimizers beyond AdamW (tests/test_training_options.py), each with its settings; full fine-tuning
#: where bitsandbytes' 8-bit state needs large tensors or Adafactor's relative steps need non-zero weights.
OPTIMIZERS = {
    "adafactor": ["method=full", "train.optimizer=adafactor", "train.lr=1e-2"],
    "lion": ["method=full", "train.optimizer=lion", "train.lr=1e-3"],
    "sgd": ["method=full", "train.optimizer=sgd", "train.lr=0.2", "train.sgd_momentum=0.9", "train.sgd_nesterov=true"],
    "schedule_free": ["method=lora", "train.optimizer=schedule_free_adamw", "train.lr_scheduler=constant", "data.eval_fraction=0.125"],
}
#: Each on backends that run it (ftctl.parallel.support refuses the others before launch).
OPTIMIZER_JOBS = [("ddp", "adafactor"), ("zero2", "lion"), ("zero3", "sgd"), ("fsdp", "sgd"), ("fsdp", "schedule_free")]
#: The tests here that use a GPU; every other one runs its ranks on the CPU with gloo, on any machine.
ON_THE_GPU = {"test_zero_fp16_overflow_on_gpu"}


@pytest.fixture(autouse=True)
def gloo_ranks_on_the_cpu(request):
    """On a GPU host too: its GPU is hidden from this process and its children (the ranks would share it)."""
    if request.node.originalname in ON_THE_GPU:
        yield
        return
    with cpu_only():
        yield


@pytest.fixture(scope="module")
def common(tiny_model_dir):
    """Overrides every run shares: the tiny model, 4 fp32 steps, 2 micro-batches of 2 per rank."""
    return [
        "recipe=tiny_lora",
        f"model.name_or_path={tiny_model_dir}",
        f"train.max_steps={STEPS}",
        "train.micro_batch_size=2",
        "train.global_batch_size=8",
        "precision=fp32",
        "method.dropout=0.0",
        "train.progress_bar=false",
        "train.tensorboard=false",
        "train.plot=false",
        "train.num_threads=1",
        "parallel.zero3_persistence_threshold=0",  # the tiny model's tensors are all below DeepSpeed's default
    ]


def _losses(run_dir: Path) -> dict:
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return {m["step"]: m for m in map(json.loads, lines) if "loss" in m}


def _eval_loss(run_dir: Path) -> float:
    lines = (Path(run_dir) / "metrics.jsonl").read_text().splitlines()
    return [m["eval_loss"] for m in map(json.loads, lines) if "eval_loss" in m][-1]


def _weights(run_dir: Path) -> dict:
    final = Path(run_dir) / "final"
    files = sorted(final.glob("adapter_model.safetensors")) or sorted(final.glob("model*.safetensors"))
    assert files, f"no weights in {final}"
    state = {}
    for f in files:
        state.update(load_file(f))
    return state


def max_relative_curve_difference(run_dir: Path, reference_dir: Path, steps=None) -> float:
    """The largest relative difference of any step's loss or gradient norm. The norm matters: AdamW and
    clipping cancel a constant factor in the gradients, so losses and weights alone would not see one."""
    got, want = _losses(run_dir), _losses(reference_dir)
    steps = steps or sorted(want)
    assert sorted(got) == sorted(steps), f"{run_dir}: logged steps {sorted(got)}, expected {steps}"
    return max(abs(got[s][key] - want[s][key]) / abs(want[s][key]) for s in steps for key in ("loss", "grad_norm"))


def max_weight_difference(run_dir: Path, reference_dir: Path) -> float:
    got, want = _weights(run_dir), _weights(reference_dir)
    assert got.keys() == want.keys(), f"{run_dir}: saved tensors differ from the single-process result"
    for key in want:
        assert got[key].shape == want[key].shape and got[key].dtype == want[key].dtype, key
        assert got[key].numel() > 0, f"{key} saved empty"
    return max(float((got[k].float() - want[k].float()).abs().max()) for k in want)


# ----------------------------------------------------------------------------------------------
# single-process references, trained in this process


@pytest.fixture(scope="module")
def references(common, tmp_path_factory):
    from ftctl.config.compose import compose_config
    from ftctl.training.run_dir import prepare_run_dir
    from ftctl.training.runner import train

    root = tmp_path_factory.mktemp("single")
    runs = {}
    with cpu_only():
        for method in ("full", "lora", "dora", "qlora"):
            cfg = compose_config([*common, "parallel=single", f"method={method}", f"output_dir={root / method}", *EXTRA.get(method, [])])
            train(cfg, prepare_run_dir(cfg))
            runs[method] = root / method
    return runs


@pytest.fixture(scope="module")
def optimizer_references(common, tmp_path_factory):
    from ftctl.config.compose import compose_config
    from ftctl.training.run_dir import prepare_run_dir
    from ftctl.training.runner import train

    root = tmp_path_factory.mktemp("single-optimizers")
    for name, overrides in OPTIMIZERS.items():
        cfg = compose_config([*common, "parallel=single", *overrides, f"output_dir={root / name}"])
        train(cfg, prepare_run_dir(cfg))
    return root


# ----------------------------------------------------------------------------------------------
# the shared torchrun launch


def harness_jobs(root: Path) -> list:
    jobs = []
    for b in BACKENDS:
        jobs += [
            {"id": f"{b}-full", "overrides": [f"parallel={b}", "method=full", f"output_dir={root / b}-full", "train.save_every=2"]},
            # Stopped after step 2 as by a SIGTERM (a checkpoint, then exit), then resumed in place.
            {"id": f"{b}-full-interrupted", "stop_after_step": 2,
             "overrides": [f"parallel={b}", "method=full", f"output_dir={root / b}-full-interrupted"]},
            {"id": f"{b}-full-resumed", "overrides": [f"parallel={b}", "method=full", f"output_dir={root / b}-full-interrupted",
                                                      "resume=auto"]},
            {"id": f"{b}-lora", "overrides": [f"parallel={b}", "method=lora", f"output_dir={root / b}-lora"]},
            # Two bf16 steps: the compute runs in bf16 while master weights and optimizer states stay fp32.
            {"id": f"{b}-bf16", "overrides": [f"parallel={b}", f"method={'full' if b in ('ddp', 'zero1', 'zero3') else 'lora'}",
                                              "precision=bf16", "train.max_steps=2", f"output_dir={root / b}-bf16"]},
        ]
    # fp16 with a gradient overflow injected on rank 0 in the first micro-batch of step 2 (forward call 2).
    jobs += [
        {"id": "ddp-fp16", "overrides": ["parallel=ddp", "method=full", "precision=fp16", f"output_dir={root}/ddp-fp16"], "overflow_at_forward": 2},
        {"id": "fsdp-fp16", "overrides": ["parallel=fsdp", "method=lora", "precision=fp16", f"output_dir={root}/fsdp-fp16"], "overflow_at_forward": 2},
    ]
    for b, method in (("fsdp", "dora"), ("zero3", "dora"), ("ddp", "qlora"), ("fsdp", "qlora"), ("zero3", "qlora")):
        jobs.append({"id": f"{b}-{method}", "overrides": [f"parallel={b}", f"method={method}", f"output_dir={root}/{b}-{method}",
                                                        *EXTRA.get(method, []), *EXTRA.get(b, [])]})
    jobs += [
        {"id": "zero3-offload", "overrides": ["parallel=zero3", "method=full", "parallel.offload_optimizer=cpu",
                                              "parallel.offload_params=cpu", f"output_dir={root}/zero3-offload"]},
        {"id": "fsdp-offload", "overrides": ["parallel=fsdp", "method=full", "parallel.offload_params=cpu", f"output_dir={root}/fsdp-offload"]},
        # Packed micro-batches carry their example boundaries through the sharding wrappers to attention.
        {"id": "fsdp-lora-packed", "overrides": ["parallel=fsdp", "method=lora", "data.packing=true", *EXTRA["fsdp"],
                                                 f"output_dir={root}/fsdp-lora-packed"]},
        {"id": "zero3-lora-packed", "overrides": ["parallel=zero3", "method=lora", "data.packing=true",
                                                  f"output_dir={root}/zero3-lora-packed"]},
        *[{"id": f"{b}-{name}", "overrides": [f"parallel={b}", *OPTIMIZERS[name], f"output_dir={root}/{b}-{name}"]}
          for b, name in OPTIMIZER_JOBS],
        # 8-bit Lion on ZeRO's flat partitions, and schedule-free AdamW stopped and resumed under FSDP.
        {"id": "zero1-lion_8bit", "overrides": ["parallel=zero1", "method=full", "train.optimizer=lion_8bit", "train.lr=1e-3",
                                                 f"output_dir={root}/zero1-lion_8bit"]},
        {"id": "fsdp-schedule_free-interrupted", "stop_after_step": 2,
         "overrides": ["parallel=fsdp", *OPTIMIZERS["schedule_free"], f"output_dir={root}/fsdp-schedule_free-interrupted"]},
        {"id": "fsdp-schedule_free-resumed", "overrides": ["parallel=fsdp", *OPTIMIZERS["schedule_free"], "resume=auto",
                                                           f"output_dir={root}/fsdp-schedule_free-interrupted"]},
        # `ftctl train` itself, started once per rank by torchrun: it must train in place.
        {"id": "cli-in-place", "cli": True, "overrides": ["parallel=ddp", "method=lora", f"output_dir={root}/cli-in-place"]},
        # ... and, failing before its first step (every example too long), leave no run dir behind.
        {"id": "cli-in-place-fails", "cli": True, "overrides": ["parallel=ddp", "method=lora", "data.max_seq_len=16",
                                                                 f"output_dir={root}/cli-in-place-fails"]},
    ]
    return jobs


@pytest.fixture(scope="module")
def harness(common, references, optimizer_references, tmp_path_factory):
    """Run every job in one 2-process torchrun launch; returns (evidence by job id, runs root)."""
    from distributed_harness import launch

    root = tmp_path_factory.mktemp("distributed")
    return launch(WORLD, common, harness_jobs(root), root, HARNESS_TIMEOUT), root


def ranks(harness, job_id):
    evidence, _ = harness
    assert job_id in evidence, f"job {job_id} did not run"
    return evidence[job_id]["ranks"]


# ----------------------------------------------------------------------------------------------
# each backend really ran as that backend


@pytest.mark.parametrize("method", ["full", "lora"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_backend_really_distributes(harness, backend, method):
    assert_distributed_by(backend, *ranks(harness, f"{backend}-{method}"))
    for r in ranks(harness, f"{backend}-{method}"):
        assert r["compute_dtypes"] == ["torch.float32"]


def assert_distributed_by(backend, r0, r1, evaluated=False, full_size_state=True):
    """What each rank holds is what the backend shards: a silent fallback to another backend fails here.

    ``evaluated``: the job ended with an eval pass, after which ZeRO-3 was seen to leave 21 of the DoRA
    model's 63 parameters gathered, so only their partitions are checked. ``full_size_state=False``:
    the optimizer keeps no state as large as the parameters (Adafactor), so none is counted."""
    full = r0["trainable_full"]
    assert r1["trainable_full"] == full and full > 0
    half = full / WORLD
    if backend == "ddp":
        assert r0["module_type"] == "DistributedDataParallel"
        for r in (r0, r1):  # everything replicated
            assert r["trainable_local"] == full and r["optimizer_state_local"] == (full if full_size_state else 0)
            assert r["grad_local_before_first_step"] == full
    elif backend == "fsdp":
        assert r0["module_type"].startswith("FSDP")
        for r in (r0, r1):
            # every trainable parameter is a DTensor holding this rank's 1/N of the rows
            assert r["dtensor_shard0"] == r["trainable_count"] == r["shard_rows_as_expected"]
            assert r["trainable_local"] <= half * 1.05 and r["optimizer_state_local"] == r["trainable_local"]
            assert r["grad_local_before_first_step"] == r["trainable_local"]  # gradients reduce-scattered
            assert r["frozen_local"] <= r["frozen_full"] / WORLD * 1.05  # the frozen base is sharded too
        assert r0["trainable_local"] + r1["trainable_local"] == full
    else:
        stage = int(backend[-1])
        assert r0["module_type"] == "DeepSpeedEngine"
        for r in (r0, r1):
            # ZeRO-1/2/3: each rank's optimizer holds its partition of the fp32 states, not all of them
            assert half * 0.95 <= r["optimizer_state_local"] <= half * 1.05
            if stage < 3:
                assert r["trainable_local"] == full  # parameters stay whole on every rank
            else:
                assert r["trainable_local"] <= half * 1.05  # parameters partitioned...
                if not evaluated:
                    assert r["released_params"] == r["param_count"]  # ...and gathered only while used
            if stage == 1:
                assert r["grad_local_before_first_step"] == full  # full gradients until the step
            else:
                assert r["grad_local_before_first_step"] < full / 4  # reduced into partitions during backward
        assert r0["optimizer_state_local"] + r1["optimizer_state_local"] >= full


# ----------------------------------------------------------------------------------------------
# all backends train the same model


@pytest.mark.parametrize("method", ["full", "lora"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_same_loss_curve_and_weights_as_single_process(harness, references, backend, method):
    _, root = harness
    run = root / f"{backend}-{method}"
    loss_difference = max_relative_curve_difference(run, references[method])
    weight_difference = max_weight_difference(run, references[method])
    print(f"{backend}-{method}: max relative loss difference {loss_difference:.2e}, max weight difference {weight_difference:.2e}")
    assert loss_difference <= LOSS_RTOL
    assert weight_difference <= WEIGHT_ATOL


@pytest.mark.parametrize("backend", BACKENDS)
def test_an_interrupted_run_resumes_exactly(harness, backend):
    _, root = harness
    original, resumed = root / f"{backend}-full", root / f"{backend}-full-interrupted"
    assert [r["interrupted"] for r in ranks(harness, f"{backend}-full-interrupted")] == [True, True]
    # No save_every: step 2 is the stop's own checkpoint, step 4 the one every run keeps of its last step.
    assert sorted(p.name for p in (resumed / "checkpoints").iterdir()) == ["step-2", "step-4"]
    state_dir = {"fsdp": "fsdp_state", "ddp": None}.get(backend, "deepspeed")
    for run in (original, resumed):
        if state_dir:
            assert (run / "checkpoints" / "step-2" / state_dir).is_dir()
    assert [r["interrupted"] for r in ranks(harness, f"{backend}-full-resumed")] == [False, False]
    # steps 1-2 before the stop and 3-4 after the resume are the steps of the uninterrupted run
    assert max_relative_curve_difference(resumed, original) <= 1e-6
    assert max_weight_difference(resumed, original) <= 1e-6


@pytest.mark.parametrize("job, reference", [
    ("fsdp-dora", "dora"), ("zero3-dora", "dora"),
    ("ddp-qlora", "qlora"), ("fsdp-qlora", "qlora"), ("zero3-qlora", "qlora"),
    ("zero3-offload", "full"), ("fsdp-offload", "full"),
])
def test_dora_qlora_and_offload_match_single_process(harness, references, job, reference):
    _, root = harness
    assert max_relative_curve_difference(root / job, references[reference]) <= LOSS_RTOL
    assert max_weight_difference(root / job, references[reference]) <= WEIGHT_ATOL
    if reference == "dora":
        assert _eval_loss(root / job) == pytest.approx(_eval_loss(references["dora"]), rel=LOSS_RTOL)
    r0, r1 = ranks(harness, job)
    assert_distributed_by(job.split("-")[0], r0, r1, evaluated=reference == "dora")
    if job in ("fsdp-qlora", "zero3-qlora"):  # the packed 4-bit codes are sharded like any weight
        for r in (r0, r1):
            assert r["frozen_local"] <= r["frozen_full"] / WORLD * 1.05


@pytest.mark.parametrize("backend, optimizer", OPTIMIZER_JOBS)
def test_other_optimizers_match_single_process(harness, optimizer_references, backend, optimizer):
    _, root = harness
    run, reference = root / f"{backend}-{optimizer}", optimizer_references / optimizer
    loss_difference = max_relative_curve_difference(run, reference)
    weight_difference = max_weight_difference(run, reference)
    print(f"{backend}-{optimizer}: max relative loss difference {loss_difference:.2e}, max weight difference {weight_difference:.2e}")
    assert loss_difference <= LOSS_RTOL
    assert weight_difference <= WEIGHT_ATOL
    if optimizer == "schedule_free":  # evaluated at its average on every rank
        assert _eval_loss(run) == pytest.approx(_eval_loss(reference), rel=LOSS_RTOL)
    assert_distributed_by(backend, *ranks(harness, f"{backend}-{optimizer}"), evaluated=optimizer == "schedule_free",
                          full_size_state=optimizer != "adafactor")


def test_lion_8bit_trains_on_zero_partitions_and_schedule_free_resumes_exactly_under_fsdp(harness):
    _, root = harness
    curve = [m["loss"] for m in _losses(root / "zero1-lion_8bit").values()]
    assert len(curve) == STEPS and curve[-1] < curve[0]
    assert_distributed_by("zero1", *ranks(harness, "zero1-lion_8bit"))
    # 8-bit blocks for the matrices' partition; the norms' partition is below bitsandbytes' 4096 elements.
    assert all(r["optimizer_state_dtypes"] == ["torch.float32", "torch.uint8"] for r in ranks(harness, "zero1-lion_8bit"))
    assert [r["interrupted"] for r in ranks(harness, "fsdp-schedule_free-interrupted")] == [True, True]
    resumed, original = root / "fsdp-schedule_free-interrupted", root / "fsdp-schedule_free"
    assert max_relative_curve_difference(resumed, original) <= 1e-6
    assert max_weight_difference(resumed, original) <= 1e-6
    assert _eval_loss(resumed) == pytest.approx(_eval_loss(original), rel=1e-6)


@pytest.mark.parametrize("job", ["fsdp-lora-packed", "zero3-lora-packed"])
def test_packed_batches_train_like_padded_ones_when_sharded(harness, references, job):
    from ftctl.training.metrics import read_metrics

    _, root = harness
    assert max_relative_curve_difference(root / job, references["lora"]) <= LOSS_RTOL
    assert max_weight_difference(root / job, references["lora"]) <= WEIGHT_ATOL
    waste = [[m["padding_waste"] for m in read_metrics(d) if "loss" in m] for d in (root / job, references["lora"])]
    assert all(packed < padded for packed, padded in zip(*waste))
    assert_distributed_by(job.split("-")[0], *ranks(harness, job))


@pytest.mark.parametrize("backend", ["ddp", "fsdp"])
def test_fp16_overflow_skips_the_step_lowers_the_scale_and_training_goes_on(harness, backend):
    _, root = harness
    _check_overflow_handled(_losses(root / f"{backend}-fp16"))
    assert_distributed_by(backend, *ranks(harness, f"{backend}-fp16"))
    for r in ranks(harness, f"{backend}-fp16"):  # fp16 compute; AMP's master weights and states stay fp32
        assert r["compute_dtypes"] == ["torch.float16"]
        assert r["trainable_dtypes"] == ["torch.float32"] and r["optimizer_state_dtypes"] == ["torch.float32"]


@pytest.mark.parametrize("backend", BACKENDS)
def test_bf16_trains_with_fp32_master_weights(harness, references, backend):
    _, root = harness
    job = f"{backend}-bf16"
    steps = _losses(root / job)
    method = "full" if backend in ("ddp", "zero1", "zero3") else "lora"
    fp32 = _losses(references[method])
    assert sorted(steps) == [1, 2]
    # The first two steps have the same learning rates (warmup) as the 4-step fp32 reference; bf16
    # compute stays within 5e-3 of it, while the update of step 1 alone moves the loss by ~1%.
    for step in (1, 2):
        assert abs(steps[step]["loss"] - fp32[step]["loss"]) / fp32[step]["loss"] < 5e-3
    assert steps[1]["loss"] != fp32[1]["loss"]  # bf16 rounding shows in the very first loss
    assert_distributed_by(backend, *ranks(harness, job))
    for r in ranks(harness, job):
        assert r["compute_dtypes"] == ["torch.bfloat16"]  # the matmuls ran in bf16, not just the config said so
        assert r["trainable_dtypes"] == ["torch.float32"] and r["optimizer_state_dtypes"] == ["torch.float32"]


def test_ftctl_train_runs_in_place_under_torchrun(harness, references):
    _, root = harness
    assert [r["returncode"] for r in ranks(harness, "cli-in-place")] == [0, 0]
    run = root / "cli-in-place"
    assert "parallel=ddp×2" in (run / "train.log").read_text()
    assert max_relative_curve_difference(run, references["lora"]) <= LOSS_RTOL


def test_ftctl_train_in_place_failing_before_its_first_step_leaves_no_run_dir(harness):
    _, root = harness
    assert [r["returncode"] for r in ranks(harness, "cli-in-place-fails")] == [1, 1]
    assert not (root / "cli-in-place-fails").exists()


# ----------------------------------------------------------------------------------------------
# ftctl starting its own workers


def _ftctl(args, env=None, timeout=300):
    return subprocess.run([sys.executable, "-m", "ftctl", "train", *args], capture_output=True, text=True,
                          timeout=timeout, env=dict(os.environ, **(env or {})))


def test_ftctl_train_launches_its_workers(common, references, tmp_path, tiny_model_dir):
    run = tmp_path / "zero2"
    proc = _ftctl([*common, "parallel=zero2", "parallel.nproc_per_node=2", "method=lora", f"output_dir={run}"])
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    assert "done: 4 steps" in proc.stdout
    assert "parallel=zero2×2" in (run / "train.log").read_text()
    ds_config = json.loads((run / "deepspeed_config.json").read_text())
    assert ds_config["zero_optimization"]["stage"] == 2 and ds_config["gradient_accumulation_steps"] == 2
    hidden = json.loads((tiny_model_dir / "config.json").read_text())["hidden_size"]
    assert ds_config["zero_optimization"]["reduce_bucket_size"] == hidden * hidden  # not DeepSpeed's 5e8 elements
    assert max_relative_curve_difference(run, references["lora"]) <= LOSS_RTOL
    assert max_weight_difference(run, references["lora"]) <= WEIGHT_ATOL


def test_sigterm_to_ftctl_train_reaches_its_workers(common, tmp_path):
    import signal
    import time

    run = tmp_path / "stopped"
    parent = subprocess.Popen([sys.executable, "-m", "ftctl", "train", *common, "parallel=fsdp", "method=lora",
                               "train.max_steps=100000", f"output_dir={run}"],
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not ((run / "metrics.jsonl").is_file() and (run / "metrics.jsonl").read_text().strip()):
        assert parent.poll() is None and time.monotonic() < deadline, parent.communicate()
        time.sleep(0.5)
    parent.send_signal(signal.SIGTERM)  # what a scheduler sends: only to ftctl, which passes it on
    out, err = parent.communicate(timeout=120)
    assert parent.returncode == 143, out[-2000:] + err[-4000:]
    assert "ftctl: error: SIGTERM at step" in err and "resume=auto" in err and "Traceback" not in err
    assert "death signal" not in err  # torch's launcher keeps its own log lines to itself
    assert (run / "train.log").read_text().count("ERROR stopped: SIGTERM at step") == 1
    assert [p.name.startswith("step-") for p in (run / "checkpoints").iterdir()] == [True]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_nodes_on_localhost_with_cluster_flags(common, references, tmp_path):
    # The port is free when chosen but released before torchrun binds it, so another process may take it
    # in between: that failure (and only that one) is retried on a fresh port.
    for attempt in range(3):
        run = tmp_path / f"two-nodes-{attempt}"
        flags = [*common, "parallel=fsdp", "method=full", f"output_dir={run}", "parallel.nnodes=2", "parallel.nproc_per_node=1",
                 "parallel.master_addr=127.0.0.1", f"parallel.master_port={_free_port()}"]
        nodes = [subprocess.Popen([sys.executable, "-m", "ftctl", "train", *flags, f"parallel.node_rank={rank}"],
                                  stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for rank in (0, 1)]
        outputs = [node.communicate(timeout=300) for node in nodes]
        if not any(node.returncode and "address already in use" in err.lower() for node, (_, err) in zip(nodes, outputs)):
            break
    for node, (out, err) in zip(nodes, outputs):
        assert node.returncode == 0, out[-2000:] + err[-4000:]
    assert "done: 4 steps" in outputs[0][0]
    assert "parallel=fsdp×2" in (run / "train.log").read_text()
    assert max_relative_curve_difference(run, references["full"]) <= LOSS_RTOL
    assert max_weight_difference(run, references["full"]) <= WEIGHT_ATOL


# ----------------------------------------------------------------------------------------------
# refusals and launcher plumbing (no training)


def test_unsupported_combinations_are_refused_before_launch(common, tmp_path, capsys):
    from ftctl.cli import main
    from ftctl.config.compose import compose_config
    from ftctl.parallel.support import check_supported

    cfg = compose_config([*common, "parallel=zero2", "precision=fp16"])
    with pytest.raises(ConfigError, match="DeepSpeed's fp16 mode.*only on GPUs"):
        check_supported(cfg, "cpu")
    check_supported(cfg, "cuda")  # fine on a GPU
    run = tmp_path / "refused"
    assert main(["train", *common, "parallel=zero2", "precision=fp16", f"output_dir={run}"]) == 2
    assert "only on GPUs" in capsys.readouterr().err and not run.exists()
    for overrides, message in [
        (["parallel=ddp", "parallel.offload_optimizer=cpu"], "optimizer offload needs parallel=zero1, zero2 or zero3"),
        (["parallel=fsdp", "parallel.offload_optimizer=cpu"], "set parallel.offload_params=cpu instead"),
        (["parallel=zero2", "parallel.offload_params=cpu"], "partitions parameters"),
        (["parallel=zero3", "method=qlora", "parallel.offload_params=cpu"], "does not offload bitsandbytes 4-bit"),
        (["parallel=ddp", "parallel.rdzv_backend=etcd"], "rdzv_backend"),
        (["parallel=single", "parallel.nproc_per_node=2"], "parallel=single runs one process"),
    ]:
        with pytest.raises(ConfigError, match=message):
            compose_config([*common, *overrides])
    assert main(["train", *common, "parallel=fsdp", "parallel.nnodes=2"]) == 2
    assert "explicit output_dir" in capsys.readouterr().err


def test_torchrun_arguments(common, tmp_path):
    from ftctl.config.compose import compose_config
    from ftctl.launch import torchrun_args

    config, run = tmp_path / "config.yaml", tmp_path
    one_node = torchrun_args(compose_config([*common, "parallel=ddp", "parallel.nproc_per_node=4"]), config, run)
    assert one_node[:6] == ["--nproc-per-node", "4", "--nnodes", "1", "--max-restarts", "0"]
    assert "--standalone" in one_node
    assert one_node[-5:] == ["--module", "ftctl.worker", str(config), "--run-dir", str(run)]
    static = torchrun_args(compose_config([*common, "parallel=fsdp", "parallel.nnodes=2", "parallel.node_rank=1",
                                           "parallel.master_addr=10.0.0.1", "parallel.master_port=1234"]), config, run)
    assert static[6:16] == ["--rdzv-backend", "static", "--node-rank", "1", "--master-addr", "10.0.0.1", "--master-port", "1234",
                            "--module", "ftctl.worker"]
    c10d = torchrun_args(compose_config([*common, "parallel=zero3", "parallel.nnodes=4", "parallel.rdzv_backend=c10d", "train.micro_batch_size=1",
                                         "parallel.master_addr=head", "parallel.rdzv_id=job7"]), config, run)
    assert c10d[6:14] == ["--rdzv-backend", "c10d", "--rdzv-endpoint", "head:29500", "--rdzv-id", "job7", "--node-rank", "0"]


def test_process_place_from_launcher_environments():
    from ftctl.parallel.place import first_slurm_host, inside_launcher, process_place

    torchrun = {"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "n0", "MASTER_PORT": "29400"}
    assert process_place(torchrun) == process_place(torchrun).__class__(3, 8, 1, "n0", 29400, "torchrun")
    srun = {"SLURM_STEP_ID": "0", "SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1",
            "SLURM_JOB_NODELIST": "gpu[03-04,9]"}
    place = process_place(srun)
    assert (place.rank, place.world_size, place.local_rank, place.master_addr, place.launcher) == (5, 8, 1, "gpu03", "slurm")
    assert not inside_launcher({"SLURM_NTASKS": "8", "SLURM_PROCID": "0"})  # a batch script, not an srun step
    assert not inside_launcher({})
    assert first_slurm_host("cpu1,cpu2") == "cpu1"


def test_worker_errors_become_one_message(tmp_path, monkeypatch):
    from ftctl.errors import FtctlError
    from ftctl.launch import ERROR_DIR_ENV, report_worker_error, worker_failure

    monkeypatch.setenv(ERROR_DIR_ENV, str(tmp_path))
    for rank in (0, 1):
        assert report_worker_error(rank, FtctlError("step 3: the loss is nan"))
    error = worker_failure(tmp_path, 1)
    assert type(error) is FtctlError and str(error) == "step 3: the loss is nan"
    report_worker_error(1, ConfigError("bad batch"))
    assert str(worker_failure(tmp_path, 1)) == "rank 0: step 3: the loss is nan\nrank 1: bad batch"
    from ftctl.training.interrupts import TrainingInterrupted

    for rank in (0, 1):
        report_worker_error(rank, TrainingInterrupted("SIGTERM at step 5"))
    assert worker_failure(tmp_path, 143).exit_code == 143  # as a single-process run would exit
    assert "output is above" in str(worker_failure(tmp_path / "none", 1))


# ----------------------------------------------------------------------------------------------
# in-process: one process (CPU), ZeRO fp16 (GPU only)


def _train_with_overflow(cfg, at_forward: int) -> dict:
    """Train ``cfg`` here with the backward of forward call ``at_forward`` poisoned; returns its metrics by step."""
    import ftctl.training.runner as runner
    from distributed_harness import install_overflow
    from ftctl.training.run_dir import prepare_run_dir

    create_backend = runner.create_backend

    def backend_with_overflow(cfg):
        backend = create_backend(cfg)
        prepare = backend.prepare

        def prepare_with_overflow(model, make_optimizer, precision):
            install_overflow(model, at_forward)
            return prepare(model, make_optimizer, precision)

        backend.prepare = prepare_with_overflow
        return backend

    runner.create_backend = backend_with_overflow
    try:
        runner.train(cfg, prepare_run_dir(cfg))
    finally:
        runner.create_backend = create_backend
    return _losses(cfg.output_dir)


def _check_overflow_handled(steps: dict) -> None:
    """Step 2 (poisoned) is skipped and halves the scale; the other steps apply and training goes on."""
    assert [steps[s]["skipped_steps"] for s in (1, 2, 3, 4)] == [0, 1, 1, 1]
    assert steps[2]["loss_scale"] == steps[1]["loss_scale"] / 2 == steps[4]["loss_scale"]
    assert all(torch.isfinite(torch.tensor(steps[s]["loss"])) for s in steps)
    assert steps[4]["loss"] < steps[1]["loss"]


def test_single_process_fp16_overflow_and_bf16(common, references, tmp_path):
    from ftctl.config.compose import compose_config
    from ftctl.training.run_dir import prepare_run_dir
    from ftctl.training.runner import train

    # one process, 4 micro-batches per step: the first forward of step 2 is call 4
    fp16 = compose_config([*common, "parallel=single", "method=full", "precision=fp16", f"output_dir={tmp_path / 'fp16'}"])
    _check_overflow_handled(_train_with_overflow(fp16, at_forward=4))
    bf16 = compose_config([*common, "parallel=single", "method=lora", "precision=bf16", "train.max_steps=2", f"output_dir={tmp_path / 'bf16'}"])
    train(bf16, prepare_run_dir(bf16))
    steps, fp32 = _losses(bf16.output_dir), _losses(references["lora"])
    for step in (1, 2):
        assert abs(steps[step]["loss"] - fp32[step]["loss"]) / fp32[step]["loss"] < 5e-3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: DeepSpeed's fp16 mode runs only on GPUs")
@pytest.mark.parametrize("backend", ["zero1", "zero2", "zero3"])
def test_zero_fp16_overflow_on_gpu(common, tmp_path, backend):
    from ftctl.config.compose import compose_config

    cfg = compose_config([*common, f"parallel={backend}", "parallel.nproc_per_node=1", "precision=fp16",
                          "method=full", f"output_dir={tmp_path / backend}"])
    _check_overflow_handled(_train_with_overflow(cfg, at_forward=4))
