"""parallel=mesh on CPU processes (gloo): every composition equals one process, shards what it says, resumes and exports.

Three torchrun launches of tests/distributed_harness.py (2, 4 and 8 processes) train every job
below in sequence through the real runner and record, per rank, what the mesh really holds (each
parameter's DTensor placements and mesh axes, local parameter bytes, the decoder layers of its
stages, its experts). The tests compare the loss and gradient norm of every step with
single-process runs trained here, and read the evidence. Tiny models (2 or 4 layers, hidden 64),
3 steps each.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest

from devices import cpu_only
from test_parallel import _losses, max_relative_curve_difference, ranks

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module", autouse=True)
def gloo_ranks_on_the_cpu():
    """On a GPU host too, before the module's runs: its GPU is hidden from this process and its children."""
    with cpu_only():
        yield

STEPS = 3
RTOL = 1e-5  # loss and gradient norm of every step, relative to one process (fp32)
QLORA_RTOL = 1e-4  # 4-bit dequantisation in another summation order
HARNESS_TIMEOUT = 900
HERE = Path(__file__).resolve().parent


@pytest.fixture(scope="module")
def models(tiny_model_dir, tmp_path_factory):
    from ftctl.models.tiny import build_tiny_model

    root = tmp_path_factory.mktemp("mesh_models")
    return {
        "llama": tiny_model_dir,
        "llama4": build_tiny_model("llama", root / "llama4", num_layers=4),
        "mixtral": build_tiny_model("mixtral", root / "mixtral"),
        "qwen3_moe": build_tiny_model("qwen3_moe", root / "qwen3_moe"),
        "tied": build_tiny_model("llama", root / "tied", tie_word_embeddings=True),
    }


@pytest.fixture(scope="module")
def common(models):
    return [
        "recipe=tiny_lora", f"model.name_or_path={models['llama']}", f"train.max_steps={STEPS}", "train.micro_batch_size=2",
        "train.global_batch_size=8", "precision=fp32", "method.dropout=0.0", "data.max_seq_len=128",
        "train.progress_bar=false", "train.tensorboard=false", "train.plot=false", "train.num_threads=1",
    ]


ATTENTION = "method.target_modules=[q_proj,k_proj,v_proj,o_proj]"
#: Single-process references: name -> overrides.
REFERENCES = {
    "full": ["method=full"], "full_eval": ["method=full", "data.eval_fraction=0.125"], "lora": ["method=lora"], "dora": ["method=dora"], "qlora": ["method=qlora"],
    "lora4": ["method=lora", "MODEL=llama4"], "mixtral": ["method=full", "MODEL=mixtral"],
    "qwen3_moe": ["method=lora", ATTENTION, "MODEL=qwen3_moe"], "tied": ["method=full", "MODEL=tied"],
}


def _model(overrides, models):
    return [f"model.name_or_path={models[o[6:]]}" if o.startswith("MODEL=") else o for o in overrides]


@pytest.fixture(scope="module")
def references(common, models, tmp_path_factory):
    from ftctl.config.compose import compose_config
    from ftctl.training.run_dir import prepare_run_dir
    from ftctl.training.runner import train

    root = tmp_path_factory.mktemp("mesh_single")
    for name, overrides in REFERENCES.items():
        cfg = compose_config([*common, "parallel=single", *_model(overrides, models), f"output_dir={root / name}"])
        train(cfg, prepare_run_dir(cfg))
    return {name: root / name for name in REFERENCES}


def launch(world: int, jobs: list, common: list, root: Path) -> dict:
    from distributed_harness import launch as launch_harness

    # Freed tensors go back to the system at once, so the memory jobs measure what training holds.
    return launch_harness(world, common, jobs, root, HARNESS_TIMEOUT, env={"MALLOC_MMAP_THRESHOLD_": "131072"})


def launch_jobs(world: int, common: list, tmp_path_factory, jobs_in) -> tuple:
    """``jobs_in(root)`` and the memory jobs of this many processes in one launch: (evidence, root)."""
    root = tmp_path_factory.mktemp(f"mesh{world}")
    return launch(world, [*jobs_in(root), *memory_jobs(world, root)], common, root), root


def job(job_id, root, *overrides, **extra):
    return {"id": job_id, "overrides": [*overrides, f"output_dir={root / job_id}"], **extra}


def stopped_and_resumed(job_id, root, *overrides) -> list:
    """The job stopped after step 2 as by a SIGTERM (a checkpoint, then exit), then resumed in place: one curve."""
    return [job(job_id, root, *overrides, stop_after_step=2),
            {**job(job_id, root, *overrides, "resume=auto"), "id": f"{job_id}-resumed"}]


MESH2 = ["parallel=mesh", "parallel.nproc_per_node=2"]


WORDS = "alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega".split()


def memory_workload(root: Path) -> dict:
    """Overrides for the memory jobs by model: 4-layer, 256-wide models and examples longer than max_seq_len (full micro-batches)."""
    from ftctl.models.tiny import build_tiny_model

    shape = dict(num_layers=4, hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=768, vocab_size=512)
    models = {family: build_tiny_model(family, root / f"memory_{family}", **shape) for family in ("llama", "mixtral")}
    with open(root / "long.jsonl", "w") as f:
        for k in range(64):
            f.write(json.dumps({"instruction": " ".join(WORDS[(k + j) % 11] for j in range(20)), "input": "",
                                "output": " ".join(WORDS[(k * 3 + j) % 11] for j in range(200))}) + "\n")
    common = [f"data.path={root / 'long.jsonl'}", "train.max_steps=2", "train.micro_batch_size=4", "train.global_batch_size=16"]
    return {family: [f"model.name_or_path={path}", *common] for family, path in models.items()}


#: Per-rank memory, measured against the estimate: (processes, model, overrides) by job id.
MESH4 = ["parallel=mesh", "parallel.nproc_per_node=4"]
MEMORY_JOBS = {
    "memory-tp-full": (2, "llama", ["parallel=tp", "method=full"]),
    "memory-tp-lora": (2, "llama", ["parallel=tp", "method=lora"]),
    "memory-pp-full": (2, "llama", ["parallel=pp", "method=full"]),
    "memory-ep-full": (2, "mixtral", [*MESH2, "parallel.ep_size=2", "method=full"]),
    "memory-fsdp_tp-full": (4, "llama", ["parallel=fsdp_tp", "method=full"]),
    "memory-tp_pp-full": (4, "llama", [*MESH4, "parallel.tp_size=2", "parallel.pp_size=2", "method=full"]),
    "memory-fsdp_pp-full": (4, "llama", [*MESH4, "parallel.pp_size=2", "method=full"]),
    "memory-3d-full": (8, "llama", ["parallel=3d", "method=full"]),
}


def memory_jobs(world: int, root: Path) -> list:
    workload = memory_workload(root)
    return [job(name, root, *overrides, *workload[model], memory=True)
            for name, (processes, model, overrides) in MEMORY_JOBS.items() if processes == world]


@pytest.fixture(scope="module")
def two(common, models, references, tmp_path_factory):
    """2 processes: tp, pp with each schedule, ep, QLoRA in a pipeline, resumes, and per-rank memory."""
    return launch_jobs(2, common, tmp_path_factory, lambda root: [
        job("tp-full", root, "parallel=tp", "method=full"),
        # all-linear: o_proj and down_proj are row splits. Stopped after step 2 as by a SIGTERM (a checkpoint,
        # then exit), then resumed in place: the curve is still one process's.
        *stopped_and_resumed("tp-lora", root, "parallel=tp", "method=lora"),
        job("tp-dora", root, "parallel=tp", "method=dora"),
        job("tp-tied", root, "parallel=tp", "method=full", f"model.name_or_path={models['tied']}"),
        # 2 micro-batches of 4 rows a step, not the 4 micro-batches of 2 that gradient accumulation would give
        job("pp-gpipe", root, "parallel=pp", "parallel.pp_schedule=gpipe", "parallel.pp_microbatches=2", "method=full"),
        job("pp-1f1b", root, "parallel=pp", "parallel.pp_schedule=1f1b", "method=lora"),
        job("pp-interleaved_1f1b", root, "parallel=pp", "parallel.pp_schedule=interleaved_1f1b", "method=lora",
            f"model.name_or_path={models['llama4']}"),
        job("ep-mixtral", root, *MESH2, "parallel.ep_size=2", "method=full", f"model.name_or_path={models['mixtral']}"),
        job("ep-qwen3_moe", root, *MESH2, "parallel.ep_size=2", "method=lora", ATTENTION, f"model.name_or_path={models['qwen3_moe']}"),
        job("pp-qlora", root, "parallel=pp", "method=qlora"),
        *stopped_and_resumed("pp-resume", root, "parallel=pp", "method=full", "data.eval_fraction=0.125"),
    ])


@pytest.fixture(scope="module")
def four(common, references, tmp_path_factory):
    """4 processes: the 2-D meshes."""
    return launch_jobs(4, common, tmp_path_factory, lambda root: [
        job("fsdp_tp-lora", root, "parallel=fsdp_tp", "method=lora"),
        job("tp_pp-lora", root, *MESH4, "parallel.tp_size=2", "parallel.pp_size=2", "method=lora"),
        job("fsdp_pp-full", root, *MESH4, "parallel.pp_size=2", "method=full"),
    ])


@pytest.fixture(scope="module")
def eight(common, references, tmp_path_factory):
    """8 processes: pp 2 × dp_shard 2 × tp 2, trained, and stopped then resumed."""
    return launch_jobs(8, common, tmp_path_factory, lambda root: [
        job("3d-lora", root, "parallel=3d", "method=lora"),
        *stopped_and_resumed("3d-resume", root, "parallel=3d", "method=full"),
    ])


def curve_gap(harness, job_id, reference):
    """The largest relative gap in a step's loss or gradient norm, after checking that each step of each rank
    reduced once: the optimizer step's only collective is the step's one all-reduce, which carries the gradient
    norm's shares, and no other all-reduce runs in the step (TP's are functional, a pipeline's transfers
    point to point, FSDP's reduce-scatters; HSDP would add its replicas' all-reduces)."""
    _, root = harness
    for r in ranks(harness, job_id):
        assert r["step_collectives"] and set(r["step_collectives"]) == {1}, (job_id, r["step_collectives"])
        assert set(r["step_all_reduces"]) == {1}, (job_id, r["step_all_reduces"])
    return max_relative_curve_difference(root / job_id, reference)


# ----------------------------------------------------------------------------------------------
# 2 processes


@pytest.mark.parametrize("method", ["full", "lora", "dora"])
def test_tensor_parallel_equals_one_process_and_splits_by_the_models_plan(two, references, method):
    gap = curve_gap(two, f"tp-{method}", references[method])
    print(f"tp=2 {method}: largest relative gap in loss or grad_norm {gap:.1e}")
    assert gap <= RTOL
    for r in ranks(two, f"tp-{method}"):
        mesh = r["mesh"]
        assert mesh["mesh"] == "tp 2"
        placed = mesh["placements"]
        q = next(k for k in placed if "layers.0.self_attn.q_proj" in k and k.endswith("weight") and "lora" not in k)
        o = next(k for k in placed if "layers.0.self_attn.o_proj" in k and k.endswith("weight") and "lora" not in k)
        assert placed[q] == [["Shard(dim=0)"], ["tp"]]  # column split: output rows
        assert placed[o] == [["Shard(dim=1)"], ["tp"]]  # row split: input columns
        assert placed[next(k for k in placed if "input_layernorm" in k)] is None  # norms stay whole
        if method != "full":  # peft's rule: lora_B of a column split, lora_A of a row split
            assert placed[q.replace("base_layer.weight", "lora_B.default.weight")] == [["Shard(dim=0)"], ["tp"]]
            assert placed[q.replace("base_layer.weight", "lora_A.default.weight")] is None
            assert placed[o.replace("base_layer.weight", "lora_A.default.weight")] == [["Shard(dim=1)"], ["tp"]]
            assert placed[o.replace("base_layer.weight", "lora_B.default.weight")] is None
            down = next(k for k in placed if "mlp.down_proj.lora_A" in k)
            assert placed[down] == [["Shard(dim=1)"], ["tp"]]
        if method == "dora":
            magnitude = {k: v for k, v in placed.items() if "lora_magnitude_vector" in k and "layers.0." in k}
            assert magnitude[next(k for k in magnitude if "q_proj" in k)] == [["Shard(dim=0)"], ["tp"]]
            assert magnitude[next(k for k in magnitude if "o_proj" in k)] == [["Replicate()"], ["tp"]]
        # every rank holds about half the model's parameter bytes (norms and a factor of each adapter whole)
        assert 0.5 <= mesh["param_bytes_local"] / mesh["param_bytes_full"] <= (0.51 if method == "full" else 0.56)


def test_tied_embeddings_stay_one_weight_under_tensor_parallel(two, references):
    """The embeddings and the head are split by vocabulary one after the other; one process trains one tied weight."""
    gap = curve_gap(two, "tp-tied", references["tied"])
    print(f"tp=2 full, tied embeddings: largest relative gap {gap:.1e}")
    assert gap <= RTOL


@pytest.mark.parametrize("schedule", ["gpipe", "1f1b", "interleaved_1f1b"])
def test_each_pipeline_schedule_equals_one_process(two, references, schedule):
    reference = {"gpipe": "full", "1f1b": "lora", "interleaved_1f1b": "lora4"}[schedule]
    gap = curve_gap(two, f"pp-{schedule}", references[reference])
    print(f"pp=2 {schedule}: largest relative gap {gap:.1e}")
    assert gap <= RTOL
    r0, r1 = (r["mesh"] for r in ranks(two, f"pp-{schedule}"))
    if schedule == "interleaved_1f1b":  # 4 stages of one layer, looped over the 2 ranks
        assert (r0["layers"], r1["layers"]) == ([0, 2], [1, 3])
    else:
        assert (r0["layers"], r1["layers"]) == ([0], [1])
    assert (r0["embeddings"], r0["head"], r1["embeddings"], r1["head"]) == (True, False, False, True)
    for mesh in (r0, r1):  # a stage holds only its own layers' parameters
        assert 0.3 < mesh["param_bytes_local"] / mesh["param_bytes_full"] < 0.7


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_expert_parallel_equals_one_process_with_half_the_experts_a_rank(two, references, family):
    gap = curve_gap(two, f"ep-{family}", references[family])
    print(f"ep=2 {family}: largest relative gap {gap:.1e}")
    assert gap <= RTOL
    for r in ranks(two, f"ep-{family}"):
        experts = r["mesh"]["experts"]
        assert len(experts) == 2 and all(v == [2, 2] for v in experts.values())  # 2 of the 4 experts, 2 rows of weights
        placed = r["mesh"]["placements"]
        gate_up = next(k for k in placed if "experts.gate_up_proj" in k)
        assert "ep" in placed[gate_up][1] or "efsdp" in placed[gate_up][1]


def test_qlora_in_a_pipeline_equals_one_process(two, references):
    gap = curve_gap(two, "pp-qlora", references["qlora"])
    print(f"pp=2 qlora: largest relative gap {gap:.1e}")
    assert gap <= QLORA_RTOL


@pytest.mark.parametrize("job_id, reference", [("tp-lora", "lora"), ("pp-resume", "full_eval")])
def test_a_stopped_run_resumes_exactly(two, references, job_id, reference):
    _, root = two
    run = root / job_id
    assert [r["interrupted"] for r in ranks(two, job_id)] == [True, True]
    assert (run / "checkpoints" / "step-2" / "mesh_state").is_dir()
    assert max_relative_curve_difference(run, references[reference]) <= RTOL
    if job_id.startswith("pp"):  # evaluation runs through the pipeline too
        from test_parallel import _eval_loss

        assert _eval_loss(run) == pytest.approx(_eval_loss(references[reference]), rel=RTOL)


@pytest.mark.parametrize("world, harness", [(2, "two"), (4, "four"), (8, "eight")])
def test_estimate_matches_each_ranks_measured_memory(request, common, world, harness):
    """Each rank's estimate (its pipeline stage's) within 25 % of the process memory the rank added from building
    the model to the end of training (4-layer, 256-wide Llama or Mixtral, 4 × 128 tokens a micro-batch), every mesh."""
    from ftctl.config.compose import compose_config
    from ftctl.estimate import estimate_for

    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux /proc to reset the memory high-water mark")
    evidence, root = request.getfixturevalue(harness)
    workload = memory_workload(root / "estimate")
    report = []
    for name, (processes, model, overrides) in MEMORY_JOBS.items():
        if processes != world:
            continue
        estimate = estimate_for(compose_config([*common, *overrides, *workload[model], f"output_dir={root / name}"]))
        for r in ranks((evidence, root), name):
            coords = r["mesh"]["coords"]
            expected = estimate.stage_totals_bytes[coords["pp"]]
            split = [part.split()[0] for part in r["mesh"]["mesh"].split(" (")[0].split(" × ")]  # the axes above 1
            where = " ".join(f"{axis} {coords[axis]}" for axis in split)
            report.append((f"{name} rank {r['rank']} ({where}): estimate {expected / 2**20:.1f} MiB, measured "
                           f"{r['memory_increase'] / 2**20:.1f} MiB", expected / r["memory_increase"], name))
    print("\n".join(f"{line}, ratio {ratio:.2f}" for line, ratio, _ in report))
    for line, ratio, name in report:
        # tp × pp measured 0.76-0.81 over runs: a few MiB the estimate misses are not located yet (README),
        # so its floor sits below that spread rather than at it; every other mesh keeps 25 %.
        assert (0.70 if name == "memory-tp_pp-full" else 0.75) <= ratio <= 1.25, line


def _logits_of(path):
    from logit_checks import fp32_model, logits

    return logits(fp32_model(path))


def test_merge_and_export_of_tp_and_pp_runs_give_one_process_logits(two, references, tmp_path):
    import torch

    from ftctl.cli import main

    _, root = two
    for run, reference in (("tp-lora", "lora"), ("pp-1f1b", "lora")):
        merged, mine = tmp_path / f"{run}-merged", tmp_path / f"{run}-ref"
        assert main(["merge", f"adapter={root / run / 'final'}", f"output={merged}"]) == 0
        assert main(["merge", f"adapter={references[reference] / 'final'}", f"output={mine}"]) == 0
        assert torch.allclose(_logits_of(merged), _logits_of(mine), atol=1e-4, rtol=0)
    for run, reference in (("tp-full", "full"), ("pp-gpipe", "full")):
        exported = tmp_path / f"{run}-hf"
        assert main(["export", f"model={root / run / 'final'}", "format=hf", f"output={exported}"]) == 0
        assert torch.allclose(_logits_of(exported), _logits_of(references[reference] / "final"), atol=1e-4, rtol=0)


# ----------------------------------------------------------------------------------------------
# 4 and 8 processes


@pytest.mark.parametrize("job_id, reference, mesh, axes", [
    ("fsdp_tp-lora", "lora", "dp_shard 2 × tp 2", ["dp_shard", "tp"]),
    ("tp_pp-lora", "lora", "pp 2 × tp 2", ["tp"]),
    ("fsdp_pp-full", "full", "pp 2 × dp_shard 2", ["dp_shard"]),
])
def test_two_dimensional_meshes_equal_one_process(four, references, job_id, reference, mesh, axes):
    gap = curve_gap(four, job_id, references[reference])
    print(f"{job_id}: largest relative gap {gap:.1e}")
    assert gap <= RTOL
    for r in ranks(four, job_id):
        assert r["mesh"]["mesh"] == mesh
        q = next(k for k, v in r["mesh"]["placements"].items() if "q_proj" in k and "lora" not in k and k.endswith("weight"))
        assert r["mesh"]["placements"][q][1] == axes
        if "pp" in mesh:
            assert r["mesh"]["layers"] == [r["mesh"]["coords"]["pp"]]


def test_3d_on_8_processes_equals_one_process_and_resumes(eight, references):
    gap = curve_gap(eight, "3d-lora", references["lora"])
    print(f"3D pp 2 × dp_shard 2 × tp 2 lora: largest relative gap {gap:.1e}")
    assert gap <= RTOL
    for r in ranks(eight, "3d-lora"):
        mesh = r["mesh"]
        assert mesh["mesh"] == "pp 2 × dp_shard 2 × tp 2"
        assert mesh["layers"] == [mesh["coords"]["pp"]]
        q = next(k for k, v in mesh["placements"].items() if "q_proj.base_layer" in k)
        assert mesh["placements"][q][1] == ["dp_shard", "tp"]
    _, root = eight
    assert [r["interrupted"] for r in ranks(eight, "3d-resume")] == [True] * 8
    gap = max_relative_curve_difference(root / "3d-resume", references["full"])
    print(f"3D full, stopped at step 2 and resumed: largest relative gap {gap:.1e}")
    assert gap <= RTOL


# ----------------------------------------------------------------------------------------------
# a rank killed mid-run


def test_killing_one_tensor_parallel_rank_stops_the_others_in_one_line_and_resume_matches(common, tmp_path):
    """A rank killed mid-step: the other exits within 60 s, the error names the killed rank first, and a resume
    (past a damaged newest checkpoint: its DCP shards are validated like any checkpoint's files) equals one process."""
    import psutil

    from ftctl.training.checkpoint import complete_checkpoints

    run = tmp_path / "killed"
    args = [*common, "parallel=tp", "method=lora", "train.max_steps=8", "train.save_every=1", f"output_dir={run}"]
    parent = subprocess.Popen([sys.executable, "-m", "ftctl", "train", *args], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 240
    while not ((run / "metrics.jsonl").is_file() and len(_losses(run)) >= 3):  # step 2's checkpoint is complete
        assert parent.poll() is None and time.monotonic() < deadline, parent.communicate()
        time.sleep(0.05)
    workers = [p for p in psutil.Process(parent.pid).children(recursive=True)
               if "ftctl.worker" in p.cmdline() and "ftctl.launch" not in p.cmdline()]
    assert len(workers) == 2
    for worker in workers:  # frozen wherever they are (mid-step), so the run cannot end before the kill
        worker.suspend()
    workers[-1].kill()
    workers[0].resume()
    killed_at = time.monotonic()
    out, err = parent.communicate(timeout=120)
    assert time.monotonic() - killed_at < 60
    assert parent.returncode != 0 and "Traceback" not in err, err[-3000:]
    assert err.count("ftctl: error:") == 1, err[-3000:]
    lines = err.strip().splitlines()
    first = next(i for i, line in enumerate(lines) if line.startswith("ftctl: error:"))
    assert lines[first].startswith("ftctl: error: rank 1 was killed by SIGKILL"), err[-3000:]
    assert all(line.startswith("rank 0 stopped after it: ") for line in lines[first + 1:]), err[-3000:]
    assert len(_losses(run)) < 8, "the run finished before a rank was killed"
    print(f"killed after step {len(_losses(run))}; {time.monotonic() - killed_at:.1f} s to exit; {lines[first]}")
    newest, previous = complete_checkpoints(run)[-1], complete_checkpoints(run)[-2]
    shard = next((newest / "mesh_state").glob("*.distcp"))
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2])
    started = time.monotonic()
    resumed = subprocess.run([sys.executable, "-m", "ftctl", "train", *args, "resume=auto"], capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    said = resumed.stdout + resumed.stderr
    assert f"{newest.name} is damaged" in said and f"continuing from {previous.name}" in said, said[-3000:]
    print(f"resumed from {previous.name} in {time.monotonic() - started:.1f} s")
    from ftctl.config.compose import compose_config
    from ftctl.training.run_dir import prepare_run_dir
    from ftctl.training.runner import train

    cfg = compose_config([*common, "parallel=single", "method=lora", "train.max_steps=8", f"output_dir={tmp_path / 'one'}"])
    train(cfg, prepare_run_dir(cfg))
    assert max_relative_curve_difference(run, tmp_path / "one") <= RTOL
