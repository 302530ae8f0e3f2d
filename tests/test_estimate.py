"""The memory estimator: classic figures, what each backend shards, QLoRA's 4-bit weights, the CLI,
and agreement with the measured memory of real training runs."""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from ftctl.cli import main
from ftctl.config.compose import compose_config
from ftctl.errors import ConfigError
from ftctl.estimate import estimate_for, format_table

# The estimate is for the machine it runs on (its precision, the CPU-only LoRA dropout path); these are the
# CPU's figures on every machine, a GPU host's GPU hidden (tests/devices.py).
pytestmark = pytest.mark.usefixtures("on_cpu")

LLAMA2_7B_PARAMETERS = 6_738_415_616  # as published for meta-llama/Llama-2-7b-hf


@functools.lru_cache(maxsize=None)
def _compose(*overrides):
    return compose_config(list(overrides), needs_data=False)


def _estimate(*overrides, **parallel):
    """The estimate for a composed config, with parallel.* fields replaced (composing is the slow part)."""
    cfg = _compose(*overrides)
    if parallel:
        cfg = dataclasses.replace(cfg, parallel=dataclasses.replace(cfg.parallel, **parallel))
    return estimate_for(cfg)


def test_7b_full_fp32_adam_classic_figures():
    """4 bytes of weights, 4 of gradients and 8 of Adam states per parameter: 28/28/56 GB for 7B parameters."""
    e = _estimate("recipe=llama7b_full", "precision=fp32")
    assert e.parameters == e.trainable_parameters == LLAMA2_7B_PARAMETERS
    assert (e.weights_bytes, e.gradients_bytes, e.optimizer_bytes) == (4 * e.parameters, 4 * e.parameters, 8 * e.parameters)
    per_7b = 7e9 / e.parameters
    assert round(e.weights_bytes * per_7b / 1e9) == 28 and round(e.optimizer_bytes * per_7b / 1e9) == 56
    assert e.total_bytes == e.weights_bytes + e.gradients_bytes + e.optimizer_bytes + e.activations_bytes


@pytest.mark.parametrize(
    "backend, sharded",
    [("ddp", ()), ("zero1", ("optimizer",)), ("zero2", ("optimizer", "gradients")),
     ("zero3", ("optimizer", "gradients", "weights")), ("fsdp", ("optimizer", "gradients", "weights"))],
)
@pytest.mark.parametrize("method", ["full", "lora"])
def test_backends_divide_exactly_what_they_shard(backend, sharded, method):
    """Against the same backend on one rank: each part it shards is divided by N exactly, the others are unchanged."""
    common = ("recipe=llama7b_full", f"method={method}", "precision=bf16", "parallel.zero3_persistence_threshold=0")
    one = _estimate(*common, name=backend, nproc_per_node=1)
    eight = _estimate(*common, name=backend, nproc_per_node=8)
    for part in ("weights", "gradients", "optimizer"):
        expected = getattr(one, f"{part}_bytes") / 8 if part in sharded else getattr(one, f"{part}_bytes")
        assert getattr(eight, f"{part}_bytes") == pytest.approx(expected, abs=1), part
    assert eight.activations_bytes == one.activations_bytes
    assert (eight.gathered_bytes > 0) == ("weights" in sharded)


def test_zero_stage_3_fp16_is_the_zero_papers_2_2_12_over_n():
    e = _estimate("recipe=llama7b_full", "parallel=zero3", "parallel.nproc_per_node=8", "precision=fp16",
                  "parallel.zero3_persistence_threshold=0", "train.global_batch_size=64")
    p = e.parameters
    assert (e.weights_bytes, e.gradients_bytes, e.optimizer_bytes) == (2 * p // 8, 2 * p // 8, 12 * p // 8)
    # By default ZeRO-3 keeps parameters below its persistence threshold (the norms) whole on every rank.
    kept = _estimate("recipe=llama7b_full", "parallel=zero3", "parallel.nproc_per_node=8", "precision=fp16",
                     "train.global_batch_size=64")
    norms = (2 * 32 + 1) * 4096
    assert kept.weights_bytes == pytest.approx(2 * (p - norms) / 8 + 2 * norms, abs=1)


def test_ddp_keeps_a_second_copy_of_gradients_offload_moves_states():
    single = _estimate("recipe=llama7b_full", "precision=bf16")
    ddp = _estimate("recipe=llama7b_full", "precision=bf16", "parallel=ddp", "parallel.nproc_per_node=2", "train.global_batch_size=64")
    assert ddp.gradients_bytes == 2 * single.gradients_bytes
    offload = _estimate("recipe=llama7b_full", "precision=bf16", "parallel=zero2", "parallel.nproc_per_node=2",
                        "parallel.offload_optimizer=cpu", "train.global_batch_size=64")
    # Optimizer states (12 bytes a parameter with DeepSpeed's fp32 master copy) and the fp32 gradient
    # partition that feeds them go to the CPU; the device keeps the reduction buckets.
    assert offload.optimizer_bytes == 0 and offload.gradients_bytes == 0
    assert offload.offloaded_bytes == (12 + 4) * offload.parameters // 2
    assert offload.buffers_bytes == 2 * 4096 * 4096 * 4  # two fp32 buckets of hidden² elements (overlap_comm)
    resharded = _estimate("recipe=llama7b_full", "precision=bf16", "parallel=fsdp", "parallel.nproc_per_node=8")
    kept = _estimate("recipe=llama7b_full", "precision=bf16", "parallel=fsdp", "parallel.nproc_per_node=8",
                     "parallel.reshard_after_forward=false")
    layer_gap = (kept.gathered_bytes - resharded.gathered_bytes) / (32 - 2)  # 32 layers held instead of 2
    assert layer_gap == pytest.approx(4 * 202_383_360 * 7 / 8, rel=1e-6)  # one fp32 Llama-2-7B layer, 7/8 of it gathered


@pytest.mark.parametrize("double_quant, constants", [(True, 1 / 64 + 4 / (64 * 256)), (False, 4 / 64)])
def test_qlora_base_is_half_a_byte_per_parameter_plus_constants(double_quant, constants):
    e = _estimate("recipe=llama7b_qlora", "precision=bf16", f"method.double_quant={str(double_quant).lower()}")
    hidden, layers, inter = 4096, 32, 11008
    linear = layers * (4 * hidden * hidden + 3 * hidden * inter)
    unquantised = LLAMA2_7B_PARAMETERS - linear  # embeddings, norms, head: in the compute dtype, like a LoRA base
    adapters = e.trainable_parameters
    assert adapters == layers * 64 * (4 * 2 * hidden + 3 * (hidden + inter))
    assert e.weights_bytes == pytest.approx(linear * (0.5 + constants) + 2 * unquantised + 4 * adapters, abs=2)
    bf16_lora = _estimate("recipe=llama7b_lora", "precision=bf16")
    assert e.weights_bytes < 0.4 * bf16_lora.weights_bytes


def test_checkpointing_and_the_configured_activations():
    plain = _estimate("recipe=llama7b_lora", "precision=bf16", "train.gradient_checkpointing=false")
    ckpt = _estimate("recipe=llama7b_lora", "precision=bf16", "train.gradient_checkpointing=true")
    assert plain.activations_bytes == plain.activations_without_checkpointing_bytes
    assert ckpt.activations_bytes == ckpt.activations_with_checkpointing_bytes < plain.activations_bytes / 5
    double = _estimate("recipe=llama7b_lora", "precision=bf16", "train.gradient_checkpointing=false",
                       "train.micro_batch_size=8")
    # Activations grow with the micro-batch's tokens (a fixed part aside: one chunk of logits).
    assert double.activations_bytes == pytest.approx(2 * plain.activations_bytes, rel=0.01)


def test_estimate_cli_json_and_table(capsys):
    assert main(["estimate", "recipe=llama7b_lora", "precision=bf16", "parallel=zero3", "parallel.nproc_per_node=4", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    keys = ("weights_bytes", "gradients_bytes", "optimizer_bytes", "activations_bytes", "total_bytes")
    assert all(isinstance(data[k], int) and data[k] > 0 for k in keys)
    assert data["total_bytes"] == sum(data[k] for k in keys[:-1]) + data["gathered_bytes"] + data["buffers_bytes"]
    assert data["world_size"] == 4
    assert main(["estimate", "recipe=llama7b_full", "precision=fp32"]) == 0
    table = capsys.readouterr().out
    for row in ("weights", "gradients", "optimizer states", "activations, no checkpointing",
                "activations, gradient checkpointing", "total"):
        assert row in table
    assert "25.10 GiB" in table  # 4 × 6.74e9 bytes


def test_estimate_needs_an_architecture_not_weights(capsys, tmp_path):
    with pytest.raises(ConfigError, match="model.config_file"):
        _estimate("model.name_or_path=some-org/unknown-model")
    assert main(["estimate", "model.name_or_path=some-org/unknown-model"]) == 2
    assert "model.config_file" in capsys.readouterr().err
    # An alias that has not been built yet is estimated from its shipped config, without building it.
    e = _estimate("model.name_or_path=smollm2-135m-instruct", "method=lora", "method.r=8", "precision=fp32")
    assert e.parameters - e.trainable_parameters == 134_515_008
    assert not (Path(os.environ["FTCTL_HOME"]) / "models" / "smollm2-135m-instruct").exists()


def test_the_readme_shows_what_estimate_prints():
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    block = readme.split("`ftctl estimate recipe=llama7b_full precision=fp32`:")[1].split("```")[1]
    table = format_table(estimate_for(compose_config(["recipe=llama7b_full", "precision=fp32"])))
    for line in block.strip().splitlines():
        assert line in table, line


def test_dry_run_prints_the_plan_and_memory_without_training(capsys, tmp_path):
    out = tmp_path / "never"
    assert main(["train", "recipe=llama7b_qlora", "precision=bf16", f"output_dir={out}", "--dry-run"]) == 0
    text = capsys.readouterr().out
    assert "plan (dry run" in text and "method     qlora r=64" in text and "global 32 = micro 4" in text
    assert "weights" in text and "total" in text and "<- this run" in text
    assert not out.exists()


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["data.path=/nonexistent/x.jsonl"], r"data.path=/nonexistent/x.jsonl: no such file"),
        (["model.name_or_path=/nonexistent/model"], r"no such dir, alias or hub id"),
        (["data.format=alpacca"], r"Did you mean 'alpaca'\?"),
        (["train.optimizer=paged_adamw_8bit"], r"needs a CUDA device"),
        (["parallel=zero2", "parallel.nproc_per_node=2", "precision=fp16"], r"DeepSpeed's fp16 mode .* runs only on GPUs"),
        (["model.attn_implementation=flash_attention_2"], r"flash_attention_2 runs only on CUDA GPUs"),
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else None,
)
def test_dry_run_refuses_what_a_real_run_here_would(overrides, message, capsys, tmp_path):
    out = tmp_path / "never"
    assert main(["train", "recipe=tiny_lora", "precision=fp32", f"output_dir={out}", *overrides, "--dry-run"]) in (1, 2)
    captured = capsys.readouterr()
    assert captured.err.startswith("ftctl: error: ") and re.search(message, captured.err), captured.err
    if "Did you mean" not in message:  # past config validation, the plan comes first: it may be meant for another machine
        assert "plan (dry run" in captured.out
    assert not out.exists()


@pytest.mark.slow
def test_estimate_agrees_with_measured_training_memory(tmp_path):
    """Real runs of a 4-layer, 256-wide Llama on this CPU (fp32, 4 × 128 tokens per micro-batch, two
    micro-batches per step): the estimate is within 25 % of the measured increase in process memory."""
    if not Path("/proc/self/clear_refs").exists():
        pytest.skip("needs Linux /proc to reset the memory high-water mark")
    configs = ["method=full", "method=lora method.dropout=0.05", "method=full train.gradient_checkpointing=true"]
    env = dict(os.environ, MALLOC_MMAP_THRESHOLD_="131072", TOKENIZERS_PARALLELISM="false")
    probe = Path(__file__).with_name("memory_probe.py")
    proc = subprocess.run([sys.executable, str(probe), str(tmp_path), *configs], capture_output=True, text=True, env=env, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert [r["config"] for r in rows] == configs
    report = []
    for r in rows:
        ratio = r["estimate"]["total_bytes"] / r["measured_increase"]
        report.append(f"{r['config']}: estimate {r['estimate']['total_bytes'] / 2**20:.1f} MiB, "
                      f"measured {r['measured_increase'] / 2**20:.1f} MiB, ratio {ratio:.2f}")
    print("\n".join(report))
    for r, line in zip(rows, report):
        assert 0.75 <= r["estimate"]["total_bytes"] / r["measured_increase"] <= 1.25, line


@pytest.mark.parametrize("method", ["method=full", "method=lora method.dropout=0.0", "method=lora method.dropout=0.1"])
def test_layer_activations_are_what_autograd_keeps(make_cfg, method):
    """Per decoder layer, the estimate's count is exactly the bytes autograd saves (distinct storages, no
    parameters), in the runner's own model setup: packed batch, fused norms and LoRA, per-example sdpa."""
    from ftctl.estimate import _adapted_linears, layer_activation_elements
    from ftctl.models.architecture import Architecture
    from ftctl.models.loading import model_config_dict
    from saved_tensors import saved_by_decoder_layer

    cfg = make_cfg(*method.split(), "method.r=4", "precision=fp32", "data.packing=true")
    path = cfg.model.name_or_path
    saved = saved_by_decoder_layer(cfg)
    tokens = saved.tokens
    arch = Architecture.from_config(model_config_dict(path))
    adapted = _adapted_linears(cfg.method.target_modules)[0] if cfg.method.name != "full" else set()
    for i, measured in enumerate(saved.bytes_per_layer()):
        stream, matmul, masks = layer_activation_elements(
            arch, cfg.method.name, adapted, cfg.method.dropout, cfg.method.r, False,
            grad_reaches_input=cfg.method.name == "full" or i > 0, dropout_bits=True)
        assert tokens * (4 * stream + 4 * matmul + masks) == measured, f"layer {i}"


#: Parameter counts as published (the safetensors metadata of each model), for the shipped architecture
#: files. The estimate counts two norms per layer: Qwen3's q/k norms and Gemma 2's two extra norms per
#: layer are left out (at most 3.3e-5 of the model).
PUBLISHED_PARAMETERS = {
    "llama-3.1-8b.json": 8_030_261_248,
    "qwen2.5-7b-instruct.json": 7_615_616_512,
    "qwen3-8b.json": 8_190_735_360,
    "mistral-7b-instruct-v0.3.json": 7_248_023_552,
    "gemma-2-9b-it.json": 9_241_705_984,
    "phi-3-mini-4k-instruct.json": 3_821_079_552,
    "qwen3-30b-a3b.json": 30_532_122_624,
}


@pytest.mark.parametrize("name", sorted(PUBLISHED_PARAMETERS))
def test_shipped_architectures_count_the_published_parameters(name):
    from ftctl.models.architecture import Architecture
    from ftctl.paths import model_configs_dir

    arch = Architecture.from_config(json.loads((model_configs_dir() / name).read_text()), name)
    assert arch.parameters() == pytest.approx(PUBLISHED_PARAMETERS[name], rel=5e-5)


@pytest.mark.parametrize("model_type", ["mixtral", "qwen3_moe"])
def test_mixture_of_experts_parameters_match_transformers(model_type):
    """Every expert counted, as transformers builds the model (fused 3-D expert parameters, the router)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from ftctl.models.architecture import Architecture

    settings = dict(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
                    num_key_value_heads=2, head_dim=16, num_experts_per_tok=2, tie_word_embeddings=False)
    if model_type == "mixtral":
        settings.update(num_local_experts=6)
    else:  # a dense layer among the MoE ones, as Qwen-MoE's mlp_only_layers allows
        settings.update(num_experts=6, moe_intermediate_size=32, mlp_only_layers=[1])
    config = AutoConfig.for_model(model_type, **settings)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    counted = sum(p.numel() for name, p in model.named_parameters() if not name.endswith(("q_norm.weight", "k_norm.weight")))
    arch = Architecture.from_config(config.to_dict())
    assert arch.parameters() == counted
    assert arch.experts == 6 and arch.moe_layers == (3 if model_type == "mixtral" else 2)


def test_moe_estimate_counts_experts_as_frozen_weights_and_adapts_attention():
    attention = _estimate("recipe=qwen3_30b_a3b_lora", "precision=bf16")
    assert attention.parameters > 30_000_000_000 and attention.weights_bytes > 2 * 30_000_000_000
    assert attention.trainable_parameters == 48 * 16 * ((2048 + 4096) + 2 * (2048 + 512) + (4096 + 2048))
    everything = _estimate("recipe=qwen3_30b_a3b_lora", "precision=bf16", "method.target_modules=all-linear")
    assert everything.trainable_parameters == attention.trainable_parameters
    assert any("experts are fused parameters" in note for note in everything.notes)
    # QLoRA quantises linear layers only: the experts stay unquantised (at least 2 bytes each), not 4-bit.
    qlora = _estimate("recipe=qwen3_30b_a3b_lora", "precision=bf16", "method=qlora")
    assert qlora.weights_bytes > 2 * 29_000_000_000


@pytest.mark.parametrize("optimizer", ["adamw_8bit", "lion_8bit"])
def test_8bit_optimizer_state_bytes_are_what_bitsandbytes_allocates(optimizer):
    """The estimate's bytes per parameter for 8-bit states equal bitsandbytes' own allocation after one step."""
    import bitsandbytes as bnb
    import torch

    from ftctl.config.compose import compose_config
    from ftctl.estimate import optimizer_state_bytes

    weight = torch.nn.Parameter(torch.randn(64, 4096))
    opt = (bnb.optim.AdamW8bit if optimizer == "adamw_8bit" else bnb.optim.Lion8bit)([weight], lr=1e-3)
    weight.grad = torch.randn_like(weight)
    opt.step()
    allocated = sum(t.numel() * t.element_size() for t in opt.state[weight].values()
                    if isinstance(t, torch.Tensor) and t.numel() > 1)  # the step counter is not a state tensor
    cfg = compose_config(["recipe=tiny_lora", "precision=fp32", f"train.optimizer={optimizer}"])
    per_parameter = optimizer_state_bytes(cfg.train, cfg.method, arch=None)
    assert per_parameter * weight.numel() == pytest.approx(allocated, rel=0.01)
