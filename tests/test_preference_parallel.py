"""Preference objectives on every distributed backend equal one process: loss and gradient norm at every step.

One 2-process torchrun launch of tests/distributed_harness.py trains DPO with LoRA on DDP, FSDP and
ZeRO-1/2/3 (the fresh adapter's reference is the wrapped model with the adapter switched off, a
collective forward on FSDP and ZeRO-3), and full fine-tuning with precomputed reference log-probs on
ZeRO-3 (the ranks share the scoring pass and one all-reduce gathers it) and DDP (which reads what ZeRO-3
cached); and the other objectives once each: KTO on ZeRO-3 (its KL estimate is reduced over the ranks
before the step), SimPO fully fine-tuned on FSDP, ORPO with DoRA on DDP. Each must match the
single-process run of the same config, trained here. The GPU of a GPU host is hidden: gloo ranks on the CPU.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from devices import cpu_only
from distributed_harness import launch

pytestmark = pytest.mark.slow

STEPS = 3
RTOL = 1e-4  # fp32, as tests/test_parallel.py: summation order over ranks and buckets only
# The ZeRO-3 precompute job runs first: its ranks score the data (a collective pass through DeepSpeed), then DDP reads the cache.
JOBS = [("ddp", "lora", "dpo", False), ("fsdp", "lora", "dpo", False), ("zero1", "lora", "dpo", False), ("zero2", "lora", "dpo", False),
        ("zero3", "lora", "dpo", False), ("zero3", "full", "dpo", True), ("ddp", "full", "dpo", True),
        ("zero3", "lora", "kto", False), ("fsdp", "full", "simpo", False), ("ddp", "dora", "orpo", False)]
SINGLE = sorted({(method, objective) for _, method, objective, _ in JOBS})


def overrides(method: str, objective: str) -> list:
    return [f"method={method}", f"objective={objective}"] + (["data=kto_sample"] if objective == "kto" else [])


@pytest.fixture(scope="module")
def common(tiny_model_dir):
    return [
        "recipe=tiny_dpo", f"model.name_or_path={tiny_model_dir}", f"train.max_steps={STEPS}", "train.micro_batch_size=2",
        "train.global_batch_size=8", "precision=fp32", "method.dropout=0.0", "train.progress_bar=false", "train.tensorboard=false",
        "train.plot=false", "train.num_threads=1", "parallel.zero3_persistence_threshold=0",
    ]


def curve(run_dir: Path) -> dict:
    lines = (run_dir / "metrics.jsonl").read_text().splitlines()
    return {m["step"]: m for m in map(json.loads, lines) if "loss" in m}


@pytest.fixture(scope="module")
def runs(common, tmp_path_factory):
    from ftctl.config.compose import compose_config
    from ftctl.training.run_dir import prepare_run_dir
    from ftctl.training.runner import train

    root = tmp_path_factory.mktemp("preference_parallel")
    # A home of its own: the reference cache then holds only these runs' passes, whatever ran before on this worker.
    home, session_home = root / "ftctl_home", os.environ["FTCTL_HOME"]
    os.environ["FTCTL_HOME"] = str(home)
    try:
        with cpu_only():
            for method, objective in SINGLE:
                cfg = compose_config([*common, "parallel=single", *overrides(method, objective), f"output_dir={root}/single-{objective}-{method}"])
                train(cfg, prepare_run_dir(cfg))
            jobs = [{"id": f"{backend}-{objective}-{method}",
                     "overrides": [f"parallel={backend}", *overrides(method, objective), f"output_dir={root}/{backend}-{objective}-{method}",
                                   f"objective.precompute_reference={str(precompute).lower()}"]}
                    for backend, method, objective, precompute in JOBS]
            evidence = launch(2, common, jobs, root)
    finally:
        os.environ["FTCTL_HOME"] = session_home
    return root, evidence, home


@pytest.mark.parametrize("backend, method, objective, precompute", JOBS, ids=[f"{b}-{o}-{m}" for b, m, o, _ in JOBS])
def test_an_objective_on_a_backend_equals_one_process(runs, backend, method, objective, precompute):
    root, evidence, home = runs
    got, want = curve(root / f"{backend}-{objective}-{method}"), curve(root / f"single-{objective}-{method}")
    assert sorted(got) == list(range(1, STEPS + 1))
    for step in want:
        # Not the reward accuracy: at step 1 a full fine-tune is its own reference, every reward a tie within rounding.
        keys = [key for key in ("loss", "grad_norm", "rewards/margins", "kl") if key in want[step]]
        assert "loss" in keys and "grad_norm" in keys
        for key in keys:
            assert got[step][key] == pytest.approx(want[step][key], rel=RTOL, abs=1e-6), (backend, method, step, key)
    # It really ran sharded: FSDP holds DTensor shards, ZeRO-3 released its gathered parameters.
    rank0 = evidence[f"{backend}-{objective}-{method}"]["ranks"][0]
    if backend == "fsdp":
        assert rank0["dtensor_shard0"] == rank0["trainable_count"] > 0
    if backend == "zero3":
        assert rank0["released_params"] > 0
    if precompute:
        assert len(list((home / "reference_cache").glob("*.npy"))) == 1  # one pass, shared by both jobs
