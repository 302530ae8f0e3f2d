"""The one-node RMSNorm computes what transformers' RMSNorm classes compute, forward and backward."""

from __future__ import annotations

import importlib

import pytest
import torch

from ftctl.models.fast_rms_norm import SAME_AS_LLAMA, use_fast_rms_norm


#: Norm classes of other families, each computing one of the variants (rms_norm_variant finds which).
OTHER_VARIANTS = {"Gemma2RMSNorm": "one_plus_weight", "Gemma3RMSNorm": "one_plus_weight", "Olmo2RMSNorm": "weight_fp32",
                  "GptOssRMSNorm": "weight_fp32", "Phi3RMSNorm": "weight", "GraniteRMSNorm": "weight",
                  "SmolLM3RMSNorm": "weight", "MixtralRMSNorm": "weight", "Qwen3MoeRMSNorm": "weight"}
_MODULES = {"GptOss": "gpt_oss", "Qwen3Moe": "qwen3_moe"}


def _norm_class(name: str):
    family = name[: -len("RMSNorm")]
    family = _MODULES.get(family, family.lower())
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    return getattr(module, name)


def _forward_backward(norm, x, grad):
    x = x.clone().requires_grad_()
    out = norm(x)
    out.backward(grad.to(out.dtype))
    weight_grad = norm.weight.grad
    norm.weight.grad = None
    return out, x.grad, weight_grad


@pytest.mark.parametrize("class_name", sorted(SAME_AS_LLAMA | set(OTHER_VARIANTS)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("weight_trains", [True, False])
def test_same_outputs_and_gradients_as_transformers(class_name, dtype, weight_trains):
    torch.manual_seed(0)
    reference = _norm_class(class_name)(48, eps=1e-5)
    reference.weight.data.normal_()
    fast = _norm_class(class_name)(48, eps=1e-5)
    fast.weight.data.copy_(reference.weight)
    assert use_fast_rms_norm(fast) == 1
    for norm in (reference, fast):
        norm.weight.requires_grad_(weight_trains)
    x = (torch.randn(3, 7, 48) * 3).to(dtype)
    grad = torch.randn(3, 7, 48)
    expected, got = _forward_backward(reference, x, grad), _forward_backward(fast, x, grad)
    assert got[0].dtype == expected[0].dtype and got[1].dtype == x.dtype
    tolerance = {} if dtype == torch.float32 else {"rtol": 1.6e-2, "atol": 1e-2}
    for name, a, b in zip(("output", "input grad", "weight grad"), expected, got):
        if a is None:
            assert b is None and name == "weight grad" and not weight_trains
            continue
        torch.testing.assert_close(b.float(), a.float(), **tolerance, msg=f"{class_name} {dtype} {name}")


def test_swapped_into_every_norm_of_a_llama_and_training_is_unchanged(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    ids = torch.randint(0, 100, (2, 12))
    results = []
    for swap in (False, True):
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        if swap:
            assert use_fast_rms_norm(model) == 2 * model.config.num_hidden_layers + 1
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    (loss_a, grads_a), (loss_b, grads_b) = results
    torch.testing.assert_close(loss_b, loss_a)
    for name, grad in grads_a.items():
        torch.testing.assert_close(grads_b[name], grad, rtol=1e-4, atol=1e-6 * float(grad.abs().max()), msg=name)


def test_norms_with_another_formula_keep_their_forward():
    # Weight-only and with an epsilon like an RMSNorm, but it subtracts the mean: no variant computes that.
    norm = torch.nn.LayerNorm(16, bias=False)
    assert use_fast_rms_norm(norm) == 0 and "forward" not in vars(norm)
    assert use_fast_rms_norm(torch.nn.LayerNorm(16)) == 0  # a bias: not a candidate at all


@pytest.mark.parametrize("class_name", sorted(OTHER_VARIANTS))
def test_the_probe_finds_each_familys_formula(class_name):
    from ftctl.models.fast_rms_norm import rms_norm_variant

    norm = _norm_class(class_name)(16)
    norm.weight.data.normal_()
    assert rms_norm_variant(norm) == OTHER_VARIANTS[class_name]


def test_keeps_one_activation_and_the_inverse_rms_for_backward():
    """As much as transformers keeps with a frozen weight; with a trained one, one activation less."""
    reference = _norm_class("LlamaRMSNorm")(48)
    fast = _norm_class("LlamaRMSNorm")(48)
    use_fast_rms_norm(fast)
    x = torch.randn(4, 9, 48, requires_grad=True)
    for weight_trains, reference_full_size in ((False, 1), (True, 2)):
        counts = []
        for norm in (reference, fast):
            norm.weight.requires_grad_(weight_trains)
            saved = []
            with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
                norm(x)
            storages = {t.untyped_storage().data_ptr(): t for t in saved if t.numel() == x.numel()}
            inverse_rms = [t for t in saved if t.shape == (4, 9, 1)]
            counts.append((len(storages), len(inverse_rms) > 0))
        assert counts[0] == (reference_full_size, True) and counts[1] == (1, True)
