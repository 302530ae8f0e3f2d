"""`ftctl merge`: adapters folded into their base give a plain transformers model with the same outputs."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from safetensors import safe_open
from logit_checks import fp32_model, logits

SHORT_RUN = ("train.max_steps=3", "train.global_batch_size=4", "train.warmup_steps=0", "train.lr=1e-2")


@torch.no_grad()
def adapter_logits(base, adapter_dir):
    from peft import PeftModel

    return logits(PeftModel.from_pretrained(base, str(adapter_dir)))


def load_merged(out_dir):
    """Loaded the way a user without peft would load it."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(out_dir)


def assert_standalone(out_dir, dtype="F32"):
    names = {p.name for p in out_dir.iterdir()}
    assert {"model.safetensors", "config.json", "generation_config.json", "tokenizer.json", "chat_template.jinja"} <= names
    assert not any(n.startswith("adapter_") for n in names)
    with safe_open(str(out_dir / "model.safetensors"), framework="pt") as f:
        keys = list(f.keys())
        assert {f.get_slice(k).get_dtype() for k in keys} == {dtype}
    assert not [k for k in keys if "lora_" in k or "base_layer" in k or "magnitude" in k]
    assert "quantization_config" not in json.loads((out_dir / "config.json").read_text())


def nothing_written(out_dir) -> bool:
    return not out_dir.exists() and not list(out_dir.parent.glob(f".{out_dir.name}.*"))


@pytest.mark.parametrize("overrides", [["method=lora"], ["method=dora", "method.modules_to_save=[lm_head]"]], ids=["lora", "dora"])
def test_merged_model_matches_the_adapter(overrides, make_cfg, run_training, tiny_model_dir, tmp_path):
    from transformers import AutoTokenizer

    from ftctl.merging import merge

    result, _ = run_training(make_cfg(*overrides, *SHORT_RUN))
    out = merge(result.final_dir, tmp_path / "merged")
    assert_standalone(out)
    merged = logits(load_merged(out))
    expected = adapter_logits(fp32_model(tiny_model_dir), result.final_dir)
    assert (merged - expected).abs().max() <= 1e-4
    assert (merged - logits(fp32_model(tiny_model_dir))).abs().max() > 1e-3, "the adapter changed the model"
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert tokenizer.chat_template == AutoTokenizer.from_pretrained(result.final_dir).chat_template
    assert json.loads((out / "generation_config.json").read_text())["pad_token_id"] == tokenizer.pad_token_id


def test_merge_takes_checkpoints_and_casts_to_the_requested_dtype(make_cfg, run_training, tiny_model_dir, tmp_path, capsys):
    from ftctl.cli import main

    result, _ = run_training(make_cfg(*SHORT_RUN, "train.save_every=2"))
    checkpoint = result.run_dir / "checkpoints" / "step-2"
    out = tmp_path / "merged-bf16"
    assert main(["merge", f"adapter={checkpoint}", f"output={out}", f"base={tiny_model_dir}", "dtype=bfloat16"]) == 0
    assert_standalone(out, dtype="BF16")
    merged = load_merged(out)
    assert merged.dtype == torch.bfloat16
    expected = adapter_logits(fp32_model(tiny_model_dir), checkpoint)
    # The merge runs in fp32 and rounds once to bf16 (8 mantissa bits).
    assert (logits(merged.float()) - expected).abs().max() < 0.05
    assert (expected - adapter_logits(fp32_model(tiny_model_dir), result.final_dir)).abs().max() > 1e-4, "step 2 is not final"
    assert "merged" in capsys.readouterr().out

    # The output now exists: refused unless overwrite=true, then replaced whole.
    assert main(["merge", f"adapter={result.final_dir}", f"output={out}"]) != 0
    assert "not empty; choose another dir or pass overwrite=true" in capsys.readouterr().err
    assert load_merged(out).dtype == torch.bfloat16
    assert main(["merge", f"adapter={result.final_dir}", f"output={out}", "overwrite=true"]) == 0
    assert load_merged(out).dtype == torch.float32 and not list(tmp_path.glob(".merged-bf16.*"))


def test_qlora_merges_into_the_dequantised_base(make_cfg, run_training, tiny_model_dir, tmp_path, record_property):
    import bitsandbytes as bnb
    import bitsandbytes.functional as bnbf
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    from ftctl.merging import merge
    from ftctl.methods.quantization import keep_one_weight_layout

    result, _ = run_training(make_cfg("method=qlora", *SHORT_RUN))
    out = merge(result.final_dir, tmp_path / "merged")
    assert_standalone(out)
    merged = logits(load_merged(out))

    def four_bit_base():
        quant = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                   bnb_4bit_compute_dtype=torch.float32)
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, quantization_config=quant, dtype=torch.float32, device_map="cpu")
        keep_one_weight_layout(model)  # fp32 compute on AVX512-BF16 CPUs too, as ftctl's own 4-bit loads
        return model

    # The reference: the fp32 base whose projections are replaced by their NF4 round trip.
    quantized, dequantized = four_bit_base(), fp32_model(tiny_model_dir)
    for name, module in quantized.named_modules():
        if isinstance(module, bnb.nn.Linear4bit):
            weight = bnbf.dequantize_4bit(module.weight.data, module.weight.quant_state).float()
            dequantized.get_submodule(name).weight.data.copy_(weight)
    expected = adapter_logits(dequantized, result.final_dir)
    assert (merged - expected).abs().max() <= 1e-4
    vs_4bit = float((merged - adapter_logits(four_bit_base(), result.final_dir)).abs().max())
    vs_original = float((merged - adapter_logits(fp32_model(tiny_model_dir), result.final_dir)).abs().max())
    print(f"QLoRA merged vs 4-bit adapter model: max |logit diff| {vs_4bit:.2e} (vs original-weights base {vs_original:.2e})")
    record_property("qlora_merged_vs_4bit_max_logit_diff", vs_4bit)
    assert vs_4bit < 1e-3
    assert vs_original > 10 * vs_4bit, "merged into the dequantised weights, not the original ones"

    # dequantize=False: the same adapter goes into the original full-precision weights instead.
    original = merge(result.final_dir, tmp_path / "merged-original", dequantize=False)
    expected_original = adapter_logits(fp32_model(tiny_model_dir), result.final_dir)
    assert (logits(load_merged(original)) - expected_original).abs().max() <= 1e-4


def test_merge_refuses_a_missing_or_mismatched_base_and_writes_nothing(make_cfg, run_training, tiny_model_dir, tmp_path, capsys):
    from transformers import AutoConfig, AutoModelForCausalLM

    from ftctl.cli import main

    result, _ = run_training(make_cfg("train.max_steps=1", "train.global_batch_size=4"))
    out = tmp_path / "merged"
    capsys.readouterr()

    moved = tmp_path / "moved-adapter"
    shutil.copytree(result.final_dir, moved)
    config = json.loads((moved / "adapter_config.json").read_text())
    config["base_model_name_or_path"] = str(tmp_path / "gone")
    (moved / "adapter_config.json").write_text(json.dumps(config))
    assert main(["merge", f"adapter={moved}", f"output={out}"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("ftctl: error: the adapter's base model") and "pass base=DIR" in err and "Traceback" not in err
    assert nothing_written(out)

    assert main(["merge", f"adapter={result.final_dir}", f"output={out}", f"base={tmp_path / 'nope'}"]) == 1
    assert "ftctl: error: base=" in capsys.readouterr().err and nothing_written(out)

    # Same family, other shapes: a Llama with a narrower MLP.
    base_config = AutoConfig.from_pretrained(tiny_model_dir)
    base_config.intermediate_size = 96
    AutoModelForCausalLM.from_config(base_config).save_pretrained(tmp_path / "narrow")
    assert main(["merge", f"adapter={result.final_dir}", f"output={out}", f"base={tmp_path / 'narrow'}"]) == 1
    err = capsys.readouterr().err
    assert "does not match the adapter" in err and "mlp.gate_proj.lora_B is [128, 8] in the adapter but the base layer needs [96, 8]" in err
    assert nothing_written(out)


def test_merge_and_export_never_write_over_what_they_read(make_cfg, run_training, tiny_model_dir, tmp_path, capsys):
    from ftctl.cli import main

    base = tmp_path / "base"
    shutil.copytree(tiny_model_dir, base)
    result = run_training(make_cfg("train.max_steps=1", "train.global_batch_size=4", model_dir=base))[0]
    run_dir = result.run_dir
    before = {p: p.read_bytes() for p in [*run_dir.rglob("*"), *base.rglob("*")] if p.is_file()}
    attempts = [
        ["merge", f"adapter={result.final_dir}", f"output={run_dir}", "overwrite=true"],  # the run holding the adapter
        ["merge", f"adapter={result.final_dir}", f"output={result.final_dir}", "overwrite=true"],
        ["merge", f"adapter={result.final_dir}", f"base={base}", f"output={base}", "overwrite=true"],
        ["merge", f"adapter={result.final_dir}", f"base={base}", f"output={tmp_path}", "overwrite=true"],
        ["export", f"model={result.final_dir}", f"base={base}", "format=hf", f"output={base}", "overwrite=true"],
        ["export", f"model={run_dir}", "format=hf", f"output={run_dir}", "overwrite=true"],
        # The base the adapter records, not given: still an input.
        ["merge", f"adapter={run_dir / 'final'}", f"output={base}", "overwrite=true"],
        ["export", f"model={run_dir}", "format=hf", f"output={base}", "overwrite=true"],
    ]
    for args in attempts:
        assert main(args) == 1, args
        err = capsys.readouterr().err
        assert "or a dir holding it: writing it would delete what the command reads" in err, err
    assert {p: p.read_bytes() for p in before} == before


@pytest.mark.parametrize(
    "args, message",
    [
        ([], "merge needs adapter=DIR and output=DIR"),
        (["adapter=a"], "merge needs output=DIR"),
        (["adapter=a", "output=b", "dtype=int8"], "dtype=int8 is not one of float32, bfloat16, float16"),
        (["adapter=a", "output=b", "overwite=true"], "unknown merge option 'overwite'. Did you mean 'overwrite'?"),
        (["adapter=a", "output=b", "overwrite=yes"], "overwrite=yes: expected true or false"),
        (["adapter", "output=b"], "cannot read 'adapter': write key=value"),
    ],
)
def test_merge_arguments_are_checked(args, message, capsys):
    from ftctl.cli import main

    assert main(["merge", *args]) != 0
    assert message in capsys.readouterr().err
