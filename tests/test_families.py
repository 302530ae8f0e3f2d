"""Per-family capabilities, each decided by probing the model: attention kernel, packing, fused norm and head loss,
MoE adapters. The full family × method table is tests/test_family_matrix.py."""

from __future__ import annotations

import logging

import pytest
import torch

from ftctl.errors import FtctlError
from ftctl.models.tiny import TINY_FAMILIES, build_tiny_model

_dirs: dict = {}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    def get(family):
        if family not in _dirs:
            _dirs[family] = build_tiny_model(family, tmp_path_factory.mktemp(family))
        return _dirs[family]

    return get


def _load(path, **kwargs):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs)


# --- attention kernel -------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family, kernel", [("llama", "sdpa"), ("gemma2", "eager"), ("gpt_oss", "eager"), ("qwen3_moe", "sdpa")])
def test_auto_takes_the_kernel_the_model_class_has(family, kernel, tiny):
    """One decision for the implementation and the packed kernel: packed runs keep the class's sdpa and
    run the packed kernel under it (flash-attn's varlen on CUDA when installed, in half precision);
    classes without sdpa keep their own attention and refuse a packed kernel asked for by name."""
    from transformers import AutoConfig

    from ftctl.errors import ConfigError
    from ftctl.models.attention_choice import choose_attention, choose_attn_implementation
    from ftctl.models.packed_attention import KernelCapabilities

    config = AutoConfig.from_pretrained(tiny(family))
    assert choose_attn_implementation("auto", config) == kernel
    assert choose_attn_implementation("eager", config) == "eager"  # an explicit kernel is the user's
    gpu = KernelCapabilities("cuda", flash_attn=True, torch_varlen=True, flex=True)
    cpu = KernelCapabilities("cpu", flash_attn=True, torch_varlen=True, flex=True)

    def choice(caps, precision="bf16", **kw):
        picked = choose_attention("auto", config, packing=True, caps=caps, precision=precision, **kw)
        return picked.implementation, picked.packed_kernel

    if kernel == "sdpa":
        assert choice(gpu) == ("sdpa", "flash_varlen")
        assert choice(gpu, "fp32") == ("sdpa", "flex")
        assert choice(cpu) == ("sdpa", "sdpa")
    else:
        assert choice(gpu) == choice(cpu) == (kernel, None)
        with pytest.raises(ConfigError, match=r"^data.packed_attention=varlen runs in place of sdpa attention, but the "
                                              rf"model loads with {kernel} \(model.attn_implementation=auto\)"):
            choice(gpu, packed_request="varlen")
    assert choose_attention("auto", config, caps=gpu, precision="bf16").packed_kernel is None  # not packing


def test_every_loader_honours_auto_and_an_impossible_kernel_says_so(tiny):
    from ftctl.config.schema import ModelConfig
    from ftctl.models.loading import load_causal_lm

    path = str(tiny("gemma2"))
    model = load_causal_lm(ModelConfig(name_or_path=path), path, dtype=torch.float32)  # the default: auto
    assert model.config._attn_implementation == "eager"
    with pytest.raises(FtctlError, match=r"^model.attn_implementation=sdpa: Gemma2ForCausalLM has no sdpa attention; "
                                         r"use model.attn_implementation=auto \(it picks eager\)$") as info:
        load_causal_lm(ModelConfig(name_or_path=path, attn_implementation="sdpa"), path, dtype=torch.float32)
    assert "\n" not in str(info.value)


# --- packing ----------------------------------------------------------------------------------------------------


def test_packing_check_refuses_gpt_oss_and_passes_llama(tiny):
    from ftctl.models.packed_attention import use_packed_attention
    from ftctl.training.packing_check import check_packing, packed_logit_gap

    llama = _load(tiny("llama"))
    use_packed_attention(llama)
    assert packed_logit_gap(llama, 0) < 1e-5
    check_packing(llama, 0, torch.float32)
    eager_llama = _load(tiny("llama"), attn_implementation="eager")  # block-diagonal mask from position_ids
    assert packed_logit_gap(eager_llama, 0) < 1e-5

    gpt_oss = _load(tiny("gpt_oss"))
    assert packed_logit_gap(gpt_oss, 0) > 1e-2  # its masks ignore position_ids: the second example sees the first
    with pytest.raises(FtctlError, match=r"^GptOssForCausalLM mixes packed examples: .* train it with data.packing=false$"):
        check_packing(gpt_oss, 0, torch.float32)
    assert gpt_oss.training is False  # the check restores the mode it found: eval, as loaded...
    gpt_oss.train()
    with pytest.raises(FtctlError):
        check_packing(gpt_oss, 0, torch.float32)
    assert gpt_oss.training  # ...and training


# --- fused RMSNorm and head loss, by capability ------------------------------------------------------------------


@pytest.mark.parametrize("family", list(TINY_FAMILIES))
def test_fast_paths_equal_the_models_own_forward(family, tiny):
    import torch.nn.functional as F

    from ftctl.data.batching import collate
    from ftctl.data.render import IGNORE_INDEX
    from ftctl.models.fast_rms_norm import use_fast_rms_norm
    from ftctl.training.loss import head_for_loss, next_token_targets, returns_head_output, token_loss_sum

    examples = [([5, 9, 11, 40, 3, 7, 21], [IGNORE_INDEX] * 3 + [40, 3, 7, 21]), ([8, 2, 99, 4], [8, 2, 99, 4])]
    batch = collate(examples, 0, 1)
    reference = _load(tiny(family))
    logits = reference(**batch.model_inputs("cpu")).logits
    want = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), next_token_targets(batch.labels).reshape(-1),
                           ignore_index=IGNORE_INDEX, reduction="sum")
    want.backward()

    fast = _load(tiny(family))
    swapped = use_fast_rms_norm(fast)
    norms = sum(1 for m in fast.modules() if "RMSNorm" in type(m).__name__)
    assert swapped == norms  # every family here but GPT-2 (LayerNorm: norms == 0) has an RMSNorm variant
    plain_head = returns_head_output(fast)
    # Granite divides the logits, Gemma2 soft-caps them: the loss cannot come from the head alone.
    assert plain_head == (family not in ("granite", "gemma2"))
    from ftctl.models.architecture import HEAD_RETURNS_PLAIN_LOGITS  # the fallback (meta weights) and the estimator's list

    assert plain_head or fast.config.model_type not in HEAD_RETURNS_PLAIN_LOGITS
    assert (head_for_loss(fast) is not None) == plain_head
    got = token_loss_sum(fast, batch, torch.device("cpu"))
    got.backward()
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    for (name, a), (_, b) in zip(reference.named_parameters(), fast.named_parameters()):
        if a.grad is not None:
            torch.testing.assert_close(b.grad, a.grad, rtol=1e-4, atol=1e-6 + 1e-4 * float(a.grad.abs().max()), msg=name)


# --- MoE adapters -----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_moe_parameter_adapters_fit_their_base_and_not_another(family, tiny, tmp_path):
    from peft import LoraConfig, get_peft_model

    from ftctl.merging import adapter_mismatches, adapter_tensor_shapes

    model = get_peft_model(_load(tiny(family)), LoraConfig(r=4, target_modules="all-linear"))
    assert model.peft_config["default"].target_parameters  # peft adapts the fused experts as parameters
    model.save_pretrained(tmp_path)
    shapes = adapter_tensor_shapes(tmp_path)
    assert any(".experts.base_layer.lora_A" in key for key in shapes)
    from transformers import AutoConfig, AutoModelForCausalLM

    same_config, other_config = AutoConfig.from_pretrained(tiny(family)), AutoConfig.from_pretrained(tiny("llama"))
    with torch.device("meta"):
        same = AutoModelForCausalLM.from_config(same_config)
        other = AutoModelForCausalLM.from_config(other_config)
    assert adapter_mismatches(same, shapes) == []
    problems = adapter_mismatches(other, shapes)
    assert any("mlp.experts does not exist" in p for p in problems)


def test_dora_on_moe_adapts_the_linear_layers_and_names_what_it_leaves_out(tiny, caplog):
    from ftctl.config.compose import compose_config
    from ftctl.methods import create_method
    from ftctl.precision.policy import resolve_precision

    cfg = compose_config(["recipe=tiny_lora", f"model.name_or_path={tiny('mixtral')}", "method=dora", "precision=fp32"])
    cpu = torch.device("cpu")
    with caplog.at_level(logging.WARNING, logger="ftctl"):
        model = create_method(cfg).build_model(str(tiny("mixtral")), resolve_precision(cfg.precision, cpu), cpu)
    notices = [r.getMessage() for r in caplog.records if "left out" in r.getMessage()]
    assert len(notices) == 1 and "\n" not in notices[0]
    assert "model.layers.*.mlp.experts.gate_up_proj" in notices[0] and "model.layers.*.mlp.experts.down_proj" in notices[0]
    adapted = {name for name, p in model.named_parameters() if p.requires_grad}
    assert any("q_proj.lora_magnitude_vector" in n for n in adapted)
    assert not any("experts" in n for n in adapted)


def test_merge_and_chat_load_with_the_kernel_the_run_trained_with(make_cfg, run_training, tmp_path):
    from ftctl.evaluation.evaluate import load_model
    from ftctl.merging import merge_adapter

    result, _ = run_training(make_cfg("model.attn_implementation=eager", "precision=fp32", "train.max_steps=1",
                                      "train.micro_batch_size=2", "train.global_batch_size=2"))
    merged, _ = merge_adapter(result.final_dir)
    assert merged.config._attn_implementation == "eager"
    # Anything that is not a run's result loads with auto; the base of this one has sdpa.
    base, _ = load_model(_base_of(result.final_dir))
    assert base.config._attn_implementation == "sdpa"


def _base_of(adapter_dir):
    import json

    return json.loads((adapter_dir / "adapter_config.json").read_text())["base_model_name_or_path"]


@pytest.mark.parametrize("family", ["mixtral", "qwen3_moe"])
def test_moe_adapter_exports_to_hf_with_the_adapter_models_logits(family, tiny, tmp_path):
    from peft import LoraConfig, PeftModel, get_peft_model

    from ftctl.export import export_model, request_from_options

    adapted = get_peft_model(_load(tiny(family)), LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
    adapted.save_pretrained(tmp_path / "adapter")
    assert adapted.peft_config["default"].target_parameters
    written = export_model(request_from_options({"model": str(tmp_path / "adapter"), "format": "hf",
                                                 "output": str(tmp_path / "hf")}))
    exported = _load(written).eval()
    reference = PeftModel.from_pretrained(_load(tiny(family)), str(tmp_path / "adapter")).eval()
    ids = torch.tensor([[3, 17, 40, 99, 120, 7]])
    with torch.no_grad():
        want, got = reference(input_ids=ids).logits, exported(input_ids=ids).logits
        with reference.disable_adapter():
            untouched = reference(input_ids=ids).logits
    assert (got - want).abs().max().item() < 1e-4
    assert (want - untouched).abs().max().item() > 1e-3  # random (not zero) B: the experts' adapters change the output
