"""parallel=mesh before anything runs: the mesh's arithmetic, one-line refusals, the estimate and the dry run.

No torch, no processes: these run in the config layer, as `ftctl train --dry-run` and `ftctl estimate` do.
"""

from __future__ import annotations

import dataclasses

import pytest

from ftctl.cli import main
from ftctl.config.compose import compose_config
from ftctl.config.validate import gradient_accumulation_steps
from ftctl.errors import ConfigError
from ftctl.estimate import estimate_for
from ftctl.parallel.mesh_shape import (
    MeshShape, bubble_ratio, describe_stages, in_flight_microbatches, mesh_shape, stage_layer_ranges,
)

LLAMA31_70B_PARAMETERS = 70_553_706_496  # as published for meta-llama/Llama-3.1-70B


def _parallel(**sizes):
    cfg = compose_config(["recipe=tiny_lora", "parallel=mesh"])
    return dataclasses.replace(cfg.parallel, **sizes)


def test_the_mesh_takes_the_rest_of_the_world_for_data_parallel_and_lays_out_ranks_tp_innermost():
    shape = mesh_shape(_parallel(tp_size=8, pp_size=2), 64)
    assert shape == MeshShape(pp=2, dp_replicate=1, dp_shard=4, tp=8) and shape.dp == 4 and shape.world == 64
    assert shape.describe() == "pp 2 × dp_shard 4 × tp 8"
    assert shape.coordinates(0) == {"pp": 0, "dp_replicate": 0, "dp_shard": 0, "tp": 0}
    assert shape.coordinates(9) == {"pp": 0, "dp_replicate": 0, "dp_shard": 1, "tp": 1}  # TP ranks are neighbours
    assert shape.coordinates(32)["pp"] == 1
    hsdp = mesh_shape(_parallel(dp_replicate_size=2, tp_size=2), 8)
    assert (hsdp.dp_replicate, hsdp.dp_shard, hsdp.dp) == (2, 2, 4)
    moe = mesh_shape(_parallel(ep_size=4, tp_size=2), 8)
    assert (moe.dp_shard, moe.efsdp) == (4, 2)  # ep carved out of dp_shard × tp: no ranks of its own


@pytest.mark.parametrize("sizes, world, message", [
    ({"tp_size": 3}, 8, r"pp 1 × dp_replicate 1 × tp 3 = 3 does not divide the world size 8"),
    ({"tp_size": 2, "dp_shard_size": 2}, 8, r"= 4 ranks, but the world size .* is 8; set parallel.dp_shard_size=-1"),
    ({"ep_size": 4}, 6, r"ep_size=4: .* a multiple of tp_size=1 that divides 6"),
    ({"ep_size": 2, "tp_size": 4}, 8, r"ep_size must be a multiple of tp_size=4"),
    ({"tp_size": 0}, 2, r"parallel.tp_size=0 must be >= 1"),
])
def test_a_mesh_that_does_not_fit_the_world_is_one_line(sizes, world, message):
    with pytest.raises(ValueError, match=message) as caught:
        mesh_shape(_parallel(**sizes), world)
    assert "\n" not in str(caught.value)


@pytest.mark.parametrize("overrides, message", [
    (["parallel=ddp", "parallel.nproc_per_node=2", "parallel.tp_size=2"], r"parallel=ddp with parallel.tp_size=2: plain DDP .* use parallel=mesh"),
    (["parallel=zero2", "parallel.nproc_per_node=2", "parallel.pp_size=2"], r"parallel=zero2 with parallel.pp_size=2: DeepSpeed ZeRO does not run pipeline stages"),
    (["parallel=fsdp", "parallel.nproc_per_node=2", "parallel.tp_size=2"], r"parallel=fsdp with parallel.tp_size=2: mesh axes need parallel=mesh"),
    (["parallel=tp", "method=qlora"], r"method=qlora with parallel.tp_size>1: bitsandbytes' 4-bit weights cannot be split"),
    (["parallel=mesh", "parallel.ep_size=2"], r"ep_size>1 with method.target_modules=\[all-linear\]: .* name linear layers"),
    (["parallel=pp", "data.packing=true"], r"data.packing=true with parallel.pp_size>1: .* set data.packing=false"),
    (["parallel=tp", "precision=fp16"], r"parallel=mesh precision=fp16: .* use precision=bf16"),
    (["parallel=tp", "parallel.offload_params=cpu"], r"parallel=mesh does not offload"),
    (["parallel=tp", "train.optimizer=adamw_8bit"], r"train.optimizer=adamw_8bit with parallel=mesh: bitsandbytes' update kernels"),
    (["parallel=tp", "train.neftune_alpha=5"], r"train.neftune_alpha=5.0 with parallel.tp_size=2: the embeddings are split over the vocabulary"),
    (["parallel=pp", "parallel.pp_schedule=zero_bubble"], r"pp_schedule='zero_bubble' is not one of gpipe, 1f1b, interleaved_1f1b"),
    (["parallel=3d", "parallel.nproc_per_node=6"], r"does not divide the world size 6"),
    (["parallel=pp", "parallel.pp_microbatches=3"], r"pp_microbatches=3 must divide the 8 examples each pipeline takes a step"),
    (["parallel=fsdp_tp", "train.global_batch_size=6"], r"multiple of train.micro_batch_size × data-parallel ranks \(dp_replicate × dp_shard\) = 4 × 2 = 8"),
])
def test_what_no_engine_runs_is_refused_in_one_line_before_anything_loads(overrides, message):
    with pytest.raises(ConfigError, match=message) as caught:
        compose_config(["recipe=tiny_lora", *overrides])
    assert "\n" not in str(caught.value)


def test_too_many_stages_and_tied_embeddings_are_refused_before_launch(capsys, tmp_path, tiny_model_dir, monkeypatch):
    import ftctl.launch
    from ftctl.models.tiny import build_tiny_llama

    def launched(*args, **kwargs):
        raise AssertionError("workers were started for a mesh the model cannot take")

    monkeypatch.setattr(ftctl.launch, "launch_workers", launched)

    out = tmp_path / "never"
    args = ["train", "recipe=tiny_lora", f"model.name_or_path={tiny_model_dir}", "precision=fp32", f"output_dir={out}"]
    assert main([*args, "parallel=pp", "parallel.pp_size=4", "parallel.nproc_per_node=4"]) == 2
    err = capsys.readouterr().err
    assert "parallel.pp_size=4 cuts 4 pipeline stages, but the model has 2 decoder layers; use at most 2" in err
    assert err.count("\n") == 1 and not out.exists()
    assert main([*args, "parallel=pp", "parallel.pp_schedule=interleaved_1f1b"]) == 2  # 2 ranks × 2 stages each
    assert "pp_stages_per_rank=2 cuts 4 pipeline stages" in capsys.readouterr().err
    tied = build_tiny_llama(tmp_path / "tied", tie_word_embeddings=True)
    assert main([*args, f"model.name_or_path={tied}", "parallel=pp"]) == 2
    assert "tied input and output embeddings" in capsys.readouterr().err


def test_stages_split_layers_like_transformers_and_the_bubble_is_p_minus_1_over_m_plus_p_minus_1():
    assert stage_layer_ranges(5, 2) == [range(0, 3), range(3, 5)]
    assert describe_stages(4, 2, 2) == ["pp rank 0: stage 0: layer 0 + embeddings; stage 2: layer 2",
                                        "pp rank 1: stage 1: layer 1; stage 3: layer 3 + final norm, head"]
    assert bubble_ratio(2, 8) == pytest.approx(1 / 9)
    assert bubble_ratio(4, 4, per_rank=2) == pytest.approx(3 / 11)  # interleaving shrinks the bubble
    assert bubble_ratio(1, 8) == 0.0
    # in-flight micro-batches of the first pipeline rank: all of them (GPipe), p (1F1B)
    assert in_flight_microbatches("gpipe", 4, 8, 1) == 8
    assert in_flight_microbatches("1f1b", 4, 8, 1) == 4 and in_flight_microbatches("1f1b", 4, 8, 1, pp_rank=3) == 1
    assert in_flight_microbatches("interleaved_1f1b", 4, 8, 2) == pytest.approx((4 + 6 + 1) / 2)


def test_tensor_and_pipeline_ranks_share_their_batch_and_the_launch_names_the_mesh(tmp_path):
    from ftctl.launch import mesh_description, torchrun_args

    cfg = compose_config(["recipe=llama70b_3d"])
    assert gradient_accumulation_steps(cfg, 64) == 8  # 32 = micro 1 × dp 4 × 8
    assert mesh_description(cfg) == ", mesh pp 2 × dp_shard 4 × tp 8"  # from nnodes 8 × nproc_per_node 8
    args = torchrun_args(cfg, tmp_path / "config.yaml", tmp_path)
    assert args[:4] == ["--nproc-per-node", "8", "--nnodes", "8"]


def test_llama70b_3d_estimates_per_gpu_and_dry_runs(capsys, tmp_path):
    est = estimate_for(compose_config(["recipe=llama70b_3d"]))
    assert est.parameters == LLAMA31_70B_PARAMETERS
    h, inter, vocab, layers = 8192, 28672, 128256, 80
    linear = 2 * h * h + 2 * h * 1024 + 3 * h * inter  # q, o; k, v (8 KV heads of 128); gate, up, down
    # pipeline rank 0: 40 layers and the embeddings, linear weights and embeddings 1/8 (TP), norms whole,
    # everything 1/4 (FSDP); fp32 master weights, gradients and two Adam moments: 16 bytes a parameter.
    rank0 = (layers // 2) * (linear / 8 + 2 * h) + vocab * h / 8
    assert est.weights_bytes == pytest.approx(rank0 * 4 / 4, rel=1e-9)
    assert est.gradients_bytes == pytest.approx(rank0 * 4 / 4, rel=1e-9)
    assert est.optimizer_bytes == pytest.approx(rank0 * 8 / 4, rel=1e-9)
    assert est.bubble_ratio == pytest.approx(1 / 9)
    assert len(est.stage_totals_bytes) == 2 and est.total_bytes == max(est.stage_totals_bytes) < 80 * 2**30
    assert main(["train", "recipe=llama70b_3d", f"output_dir={tmp_path / 'never'}", "--dry-run"]) == 0
    text = capsys.readouterr().out
    for line in ("mesh       pp 2 × dp_shard 4 × tp 8 = 64 ranks",
                 "stages     pp rank 0: stage 0: layers 0-39 + embeddings",
                 "stages     pp rank 1: stage 1: layers 40-79 + final norm, head",
                 "pipeline   1f1b, 8 micro-batches a step; bubble (p−1)/(m+p−1) = 1/(8+1) = 11.1%",
                 "global 32 = micro 1 × 4 data-parallel ranks × 8 accumulation", "per pipeline rank: 0: "):
        assert line in text, line
    assert not (tmp_path / "never").exists()


def test_the_mesh_estimate_divides_what_each_axis_splits():
    base = ["recipe=llama7b_lora", "precision=bf16", "parallel=mesh", "parallel.nproc_per_node=8", "train.global_batch_size=64"]
    one = estimate_for(compose_config(["recipe=llama7b_lora", "precision=bf16"]))
    fsdp = estimate_for(compose_config(base))  # dp_shard 8: everything 1/8
    assert fsdp.weights_bytes == pytest.approx(one.weights_bytes / 8, rel=1e-9)
    tp = estimate_for(compose_config([*base, "parallel.tp_size=8"]))
    h, inter, vocab, layers, r = 4096, 11008, 32000, 32, 16
    frozen = layers * ((4 * h * h + 3 * h * inter) / 8 + 2 * h) + 2 * vocab * h / 8 + h  # linear, embeddings, head 1/8; norms whole
    column = 3 * (r * h + h * r / 8) + 2 * (r * h + inter * r / 8)  # q, k, v; gate, up: lora_B split
    row = (r * h / 8 + h * r) + (r * inter / 8 + h * r)  # o, down: lora_A split
    assert tp.weights_bytes == pytest.approx(2 * frozen + 4 * layers * (column + row), rel=1e-9)
    assert tp.optimizer_bytes == pytest.approx(8 * layers * (column + row), rel=1e-9)
    gpipe = estimate_for(compose_config([*base, "parallel.pp_size=2", "parallel.pp_schedule=gpipe"]))
    one_f_one_b = estimate_for(compose_config([*base, "parallel.pp_size=2"]))
    assert gpipe.activations_bytes > 1.5 * one_f_one_b.activations_bytes  # GPipe holds all 4 micro-batches, 1F1B 2
