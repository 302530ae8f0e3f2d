"""QLoRA (4-bit base), DoRA (magnitude + direction), QDoRA, and the optimizer choice, on the tiny Llama.

bitsandbytes takes the conftest model's shapes (hidden 64, intermediate 128) as they are.
"""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file

CPU = torch.device("cpu")


def build(cfg, model_dir):
    """The model exactly as the runner builds it for ``cfg``, without training it."""
    from ftctl.methods import create_method
    from ftctl.precision.policy import resolve_precision

    return create_method(cfg).build_model(str(model_dir), resolve_precision(cfg.precision, CPU), CPU)


def lm_loss(model, vocab: int = 500, seed: int = 0):
    ids = torch.randint(0, vocab, (2, 24), generator=torch.Generator().manual_seed(seed))
    return model(input_ids=ids, labels=ids).loss


def adapter_keys(final_dir):
    with safe_open(str(final_dir / "adapter_model.safetensors"), framework="pt") as f:
        return list(f.keys())


def linear_layers(model, cls=torch.nn.Linear):
    return {name: m for name, m in model.named_modules() if type(m) is cls and "lm_head" not in name}


def weight_bytes(modules) -> int:
    """Bytes of the weights as stored: parameters plus, for 4-bit layers, their quantisation constants."""
    seen, total = set(), 0
    for module in modules:
        tensors = list(module.parameters(recurse=False))
        state = getattr(getattr(module, "weight", None), "quant_state", None)
        if state is not None:
            tensors += [state.absmax, state.code]
            if state.nested:
                tensors += [state.state2.absmax, state.state2.code]
        for t in tensors:
            if t.data_ptr() not in seen:  # the code books are shared between layers
                seen.add(t.data_ptr())
                total += t.numel() * t.element_size()
    return total


def test_an_eval_pass_leaves_4bit_layers_trainable_on_any_cpu(make_cfg, tiny_model_dir, monkeypatch):
    """bitsandbytes repacks a 4-bit weight in place for AVX512-BF16 CPUs the first time a layer runs
    without gradients, after which training fails (and eval computes in bf16). ftctl keeps one layout;
    the CPU is made to look like such a CPU here, so the check means the same on every machine."""
    import bitsandbytes as bnb
    import bitsandbytes.nn.modules as bnb_modules

    monkeypatch.setattr(bnb_modules, "has_avx512bf16", lambda: True)
    model = build(make_cfg("method=qlora"), tiny_model_dir)
    layers = [m for m in model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert layers and not any(m.support_avx512bf16_for_cpu for m in layers)
    shapes = [tuple(m.weight.shape) for m in layers]
    model.eval()
    with torch.no_grad():
        before = lm_loss(model)
    assert [tuple(m.weight.shape) for m in layers] == shapes  # not repacked
    model.train()
    lm_loss(model).backward()
    model.eval()
    with torch.no_grad():
        assert torch.equal(lm_loss(model), before)


def test_qlora_base_is_4bit_packed_and_only_lora_trains(make_cfg, tiny_model_dir):
    import bitsandbytes as bnb

    model = build(make_cfg("method=qlora"), tiny_model_dir)
    quantized = linear_layers(model, bnb.nn.Linear4bit)
    assert len(quantized) == 2 * 7, "every attention and MLP projection of both layers is 4-bit"
    assert all("lora_" in name for name in linear_layers(model)), "only the LoRA matrices are full precision"
    for layer in quantized.values():
        weight = layer.weight
        assert isinstance(weight, bnb.nn.Params4bit) and weight.dtype == torch.uint8
        assert weight.numel() * 2 == layer.in_features * layer.out_features, "two 4-bit codes per stored byte"
        assert weight.quant_state.quant_type == "nf4" and weight.quant_state.nested, "NF4 with double quantisation"
        assert layer.compute_dtype == torch.float32, "compute dtype follows precision (fp32 on this CPU)"
        assert not weight.requires_grad

    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert trainable and all(".lora_A." in n or ".lora_B." in n for n in trainable), sorted(trainable)[:5]
    assert all(p.dtype == torch.float32 for n, p in model.named_parameters() if n in trainable)
    lm_loss(model).backward()
    with_grad = {name for name, p in model.named_parameters() if p.grad is not None}
    assert with_grad == trainable
    assert all(model.get_parameter(n).grad.abs().sum() > 0 for n in trainable if ".lora_B." in n)
    assert not model.get_base_model().is_activation_checkpointing
    # Counted as the parameters they stand for, not the bytes they are packed into: as many as LoRA's.
    from ftctl.methods import create_method

    lora = make_cfg("method=lora")
    assert create_method(lora).count_parameters(model) == create_method(lora).count_parameters(build(lora, tiny_model_dir))


def test_qlora_gradient_checkpointing_and_quant_options_follow_the_config(make_cfg, tiny_model_dir):
    import bitsandbytes as bnb

    model = build(
        make_cfg("method=qlora", "train.gradient_checkpointing=true", "method.quant_type=fp4",
                 "method.double_quant=false", "method.quant_storage=bfloat16"),
        tiny_model_dir,
    )
    assert model.get_base_model().is_activation_checkpointing
    layer = next(iter(linear_layers(model, bnb.nn.Linear4bit).values()))
    assert layer.weight.dtype == torch.bfloat16, "packed codes stored in the configured quant-storage dtype"
    assert layer.weight.quant_state.quant_type == "fp4" and not layer.weight.quant_state.nested
    lm_loss(model).backward()  # a checkpointed 4-bit forward still reaches the adapters
    assert any(p.grad is not None for n, p in model.named_parameters() if ".lora_B." in n)


def test_qlora_loads_with_far_fewer_weight_bytes_than_fp32(make_cfg, tiny_model_dir, record_property):
    import bitsandbytes as bnb
    from transformers import AutoModelForCausalLM

    from ftctl.methods import create_method
    from ftctl.precision.policy import resolve_precision

    cfg = make_cfg("method=qlora")
    quantized = create_method(cfg).load_base(str(tiny_model_dir), resolve_precision(cfg.precision, CPU), CPU)
    full = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    q_layers = linear_layers(quantized, bnb.nn.Linear4bit)
    f_layers = linear_layers(full)
    assert set(q_layers) == set(f_layers) and len(q_layers) == 2 * 7
    linear_ratio = weight_bytes(q_layers.values()) / weight_bytes(f_layers.values())
    model_ratio = weight_bytes(quantized.modules()) / weight_bytes(full.modules())
    print(f"QLoRA/fp32 weight bytes: projections {linear_ratio:.4f}, whole model {model_ratio:.4f}")
    record_property("qlora_fp32_weight_bytes_ratio", {"projections": linear_ratio, "model": model_ratio})
    # 4 bits of 32 is 0.125. Each layer adds its quantisation constants (1 byte per 64 weights) and a
    # fixed ~1 KB of code books, which is large only next to layers this small. Embeddings and the head stay fp32.
    assert 0.125 < linear_ratio < 0.2
    assert model_ratio < 0.6


def test_qlora_trains_only_the_adapter_and_records_its_quantisation(make_cfg, run_training):
    cfg = make_cfg("method=qlora", "train.max_steps=4", "train.global_batch_size=4", "train.warmup_steps=0",
                   "train.lr=1e-2", "train.optimizer=adamw_8bit")
    result, metrics = run_training(cfg)
    losses = [m["loss"] for m in metrics if "loss" in m]
    assert len(losses) == 4 and losses[-1] < losses[0] - 0.05
    keys = adapter_keys(result.final_dir)
    assert keys and all(".lora_A." in k or ".lora_B." in k for k in keys)
    info = json.loads((result.final_dir / "ftctl_adapter.json").read_text())
    assert info["method"] == "qlora" and info["quantization"] == {
        "quant_type": "nf4", "double_quant": True, "quant_storage": "uint8", "compute_dtype": "float32"
    }


def test_dora_has_magnitude_vectors_initialised_to_weight_norms(make_cfg, tiny_model_dir):
    model = build(make_cfg("method=dora"), tiny_model_dir)
    adapted = {n: m for n, m in model.named_modules() if hasattr(m, "lora_magnitude_vector") and m.lora_magnitude_vector}
    assert len(adapted) == 2 * 7
    for layer in adapted.values():
        magnitude = layer.lora_magnitude_vector["default"].weight
        assert magnitude.shape == (layer.out_features,) and magnitude.requires_grad
        # B = 0 at the start, so DoRA starts as the base: magnitude = row norms of W.
        torch.testing.assert_close(magnitude, layer.base_layer.weight.norm(dim=1), rtol=1e-5, atol=1e-6)
    lm_loss(model).backward()
    assert all(layer.lora_magnitude_vector["default"].weight.grad is not None for layer in adapted.values())


def test_dora_trains_its_magnitudes(make_cfg, run_training, tiny_model_dir):
    cfg = make_cfg("method=dora", "train.max_steps=4", "train.global_batch_size=4", "train.warmup_steps=0", "train.lr=1e-2")
    result, metrics = run_training(cfg)
    losses = [m["loss"] for m in metrics if "loss" in m]
    assert losses[-1] < losses[0] - 0.05
    adapter = load_file(str(result.final_dir / "adapter_model.safetensors"))
    base = load_file(str(tiny_model_dir / "model.safetensors"))
    magnitudes = {k: v for k, v in adapter.items() if k.endswith("lora_magnitude_vector")}
    assert len(magnitudes) == 2 * 7
    moved = 0.0
    for key, magnitude in magnitudes.items():
        weight = base[key.removeprefix("base_model.model.").replace("lora_magnitude_vector", "weight")]
        moved = max(moved, float((magnitude - weight.norm(dim=1)).abs().max()))
    assert moved > 1e-3, "the magnitude vectors are trained, not left at their initial norms"
    assert json.loads((result.final_dir / "adapter_config.json").read_text())["use_dora"] is True


def test_qdora_is_qlora_with_use_dora(make_cfg, run_training, tiny_model_dir):
    import bitsandbytes as bnb

    cfg = make_cfg("method=qlora", "method.use_dora=true", "train.max_steps=2", "train.global_batch_size=4")
    model = build(cfg, tiny_model_dir)
    assert len(linear_layers(model, bnb.nn.Linear4bit)) == 2 * 7
    assert any(n.endswith("lora_magnitude_vector.default.weight") and p.requires_grad for n, p in model.named_parameters())
    result, metrics = run_training(cfg)
    assert all(torch.isfinite(torch.tensor(m["loss"])) for m in metrics if "loss" in m)
    assert any(k.endswith("lora_magnitude_vector") for k in adapter_keys(result.final_dir))
    assert json.loads((result.final_dir / "ftctl_adapter.json").read_text())["use_dora"] is True


@pytest.mark.parametrize("name", ["paged_adamw_8bit", "paged_adamw_32bit"])
def test_paged_optimizers_are_a_config_error_off_cuda(make_cfg, name):
    from ftctl.errors import ConfigError
    from ftctl.training.optimizers import build_optimizer

    cfg = make_cfg("method=qlora", f"train.optimizer={name}")
    with pytest.raises(ConfigError, match=f"train.optimizer={name} needs a CUDA device"):
        build_optimizer(torch.nn.Linear(4, 4), cfg, CPU)


@pytest.mark.parametrize("method", ["full", "lora"])
def test_adamw_8bit_trains_every_method(make_cfg, run_training, method):
    _, metrics = run_training(make_cfg(f"method={method}", "train.optimizer=adamw_8bit", "train.max_steps=8"))
    losses = [m["loss"] for m in metrics if "loss" in m]
    assert len(losses) == 8 and losses[-1] < losses[0] - 0.1


def test_adamw_8bit_keeps_8bit_state_and_decays_only_matrices(make_cfg):
    import bitsandbytes as bnb

    from ftctl.training.optimizers import build_optimizer

    cfg = make_cfg("method=qlora", "train.optimizer=adamw_8bit", "train.weight_decay=0.1")
    layer = torch.nn.Linear(128, 128)  # bitsandbytes keeps tensors under 4096 elements in 32-bit
    optimizer = build_optimizer(layer, cfg, CPU)
    assert isinstance(optimizer, bnb.optim.AdamW8bit)
    assert [g["weight_decay"] for g in optimizer.param_groups] == [0.1, 0.0]
    before = layer.weight.detach().clone()
    layer(torch.randn(8, 128)).pow(2).mean().backward()
    optimizer.step()
    assert optimizer.state[layer.weight]["state1"].dtype == torch.uint8
    assert not torch.equal(before, layer.weight)
