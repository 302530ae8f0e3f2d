"""The unified runner on a tiny random Llama: full and LoRA train, results load with HF tools,
a batch's result does not depend on how it is split, and the run dir holds what it promises."""

from __future__ import annotations

import json

import pytest
import torch

from ftctl.paths import samples_dir


@pytest.fixture(scope="module")
def memorisable(tmp_path_factory):
    """Eight examples of each format: small enough to memorise in a few steps."""
    root = tmp_path_factory.mktemp("memorisable")
    files = {}
    for fmt, name in (("alpaca", "alpaca_sample.jsonl"), ("sharegpt", "sharegpt_sample.jsonl")):
        lines = (samples_dir() / name).read_text().splitlines()[:8]
        files[fmt] = root / name
        files[fmt].write_text("\n".join(lines) + "\n")
    return files


def losses(metrics):
    return [m["loss"] for m in metrics if "loss" in m]


@pytest.mark.parametrize("method, lr", [("lora", "1e-2"), ("full", "3e-3")])
@pytest.mark.parametrize("data_format", ["alpaca", "sharegpt"])
def test_methods_learn_a_memorisable_set(make_cfg, run_training, memorisable, method, lr, data_format):
    cfg = make_cfg(f"method={method}", f"data.format={data_format}", f"data.path={memorisable[data_format]}",
                   "train.max_steps=12", f"train.lr={lr}", "train.warmup_steps=0")
    result, metrics = run_training(cfg)
    curve = losses(metrics)
    assert len(curve) == 12
    assert curve[-1] < 0.6 * curve[0], curve
    assert all(k in metrics[0] for k in ("step", "loss", "lr", "tokens_per_s"))


def test_lora_first_forward_equals_base(make_cfg, tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from ftctl.methods import create_method
    from ftctl.precision.policy import resolve_precision

    cfg = make_cfg()
    device = torch.device("cpu")
    model = create_method(cfg).build_model(str(tiny_model_dir), resolve_precision(cfg.precision, device), device)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids = torch.randint(0, 400, (2, 12))
    lora_b = [p for n, p in model.named_parameters() if "lora_B" in n]
    assert lora_b and all(bool((p == 0).all()) for p in lora_b)
    assert all(p.requires_grad == ("lora_" in n) for n, p in model.named_parameters())
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, base(input_ids=ids).logits, rtol=0, atol=0)


def test_lora_result_is_a_peft_adapter_that_reproduces_the_trained_model(make_cfg, run_training, tiny_model_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    result, _ = run_training(make_cfg("train.max_steps=6", "train.save_every=3"))
    final = result.final_dir
    assert (final / "adapter_config.json").is_file() and (final / "adapter_model.safetensors").is_file()
    assert not list(final.glob("*.bin")) and not list(final.glob("*.pt"))
    assert json.loads((final / "adapter_config.json").read_text())["base_model_name_or_path"] == str(tiny_model_dir)
    loaded = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir), final)
    ids = torch.randint(0, 400, (2, 16))
    trained = result.model.eval()
    with torch.no_grad():
        expected, got = trained(input_ids=ids).logits, loaded.eval()(input_ids=ids).logits
    assert (expected - got).abs().max() <= 1e-5
    base_logits = AutoModelForCausalLM.from_pretrained(tiny_model_dir)(input_ids=ids).logits
    assert (expected - base_logits).abs().max() > 1e-3  # training changed something
    checkpoint = result.run_dir / "checkpoints" / "step-3"
    assert (checkpoint / "adapter_model.safetensors").is_file() and (checkpoint / "trainer_state.json").is_file()
    assert (checkpoint / "optimizer.rank0.pt").is_file()


def test_full_result_is_a_transformers_model_dir(make_cfg, run_training):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    result, _ = run_training(make_cfg("method=full", "train.max_steps=3"))
    final = result.final_dir
    assert (final / "model.safetensors").is_file() and not list(final.glob("*.bin"))
    loaded = AutoModelForCausalLM.from_pretrained(final)
    tokenizer = AutoTokenizer.from_pretrained(final)
    assert tokenizer.chat_template
    ids = torch.randint(0, 400, (1, 10))
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, result.model.eval()(input_ids=ids).logits)


def test_accumulation_invariance(make_cfg, run_training, tmp_path):
    """Global batch 8 as 8 micro-batches of 1 or as 2 of 4: the same loss curve and weights.

    Tolerance (fp32 compute, which make_cfg sets): 1e-5 relative on every logged loss and 5e-5 absolute
    on weights; the runs differ only by summation order and the padding of the micro-batches, which
    never reaches the loss. The weights get the looser bound because Adam divides each update by the
    gradient's own running size, which turns rounding into a visible change for an element whose
    gradient is near zero (one gate_proj element moves 1.7e-5 between the two layouts; every other
    weight stays within 3e-6)."""
    curves, weights = [], []
    for micro in (1, 4):
        cfg = make_cfg("method=full", "train.max_steps=5", "train.global_batch_size=8",
                       f"train.micro_batch_size={micro}", f"output_dir={tmp_path}/m{micro}")
        result, metrics = run_training(cfg)
        curves.append(losses(metrics))
        weights.append({k: v.detach().clone() for k, v in result.model.state_dict().items()})
    assert len(curves[0]) == 5
    for a, b in zip(*curves):
        assert abs(a - b) <= 1e-5 * abs(a), curves
    for key in weights[0]:
        torch.testing.assert_close(weights[0][key], weights[1][key], rtol=0, atol=5e-5)


def test_seeded_runs_are_identical_and_checkpointing_changes_nothing(make_cfg, run_training, tmp_path):
    runs = [
        make_cfg("train.max_steps=3", f"output_dir={tmp_path}/a"),
        make_cfg("train.max_steps=3", f"output_dir={tmp_path}/b"),
        make_cfg("train.max_steps=3", "train.gradient_checkpointing=true", f"output_dir={tmp_path}/c"),
    ]
    curves = [losses(run_training(cfg)[1]) for cfg in runs]
    assert curves[0] == curves[1]
    for a, c in zip(curves[0], curves[2]):
        assert abs(a - c) <= 1e-5 * abs(a)


def test_eval_split_logs_eval_loss_and_tensorboard(make_cfg, run_training):
    result, metrics = run_training(make_cfg("train.max_steps=4", "train.eval_every=2", "data.eval_fraction=0.25",
                                            "train.tensorboard=true"))
    evals = [m for m in metrics if "eval_loss" in m]
    assert [m["step"] for m in evals] == [2, 4]
    assert result.last_eval_loss == pytest.approx(evals[-1]["eval_loss"], rel=1e-7)
    # Read back through TensorBoard's own reader: every metrics line's numbers, at their steps.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from ftctl.training.trackers import numeric_values

    events = EventAccumulator(str(result.run_dir / "tensorboard"), size_guidance={"scalars": 0})
    events.Reload()
    logged = {tag: {e.step: e.value for e in events.Scalars(tag)} for tag in events.Tags()["scalars"]}
    expected = {}
    for line in metrics:
        for tag, value in numeric_values(line).items():
            expected.setdefault(tag, {})[line["step"]] = value
    assert {"train/loss", "eval/eval_loss", "train/grad_norm", "train/lr"} <= set(expected)
    assert set(logged) == set(expected)
    for tag, by_step in expected.items():
        assert logged[tag] == pytest.approx(by_step, rel=1e-6), tag  # TensorBoard keeps float32


def test_a_metrics_line_covers_every_step_since_the_last(make_cfg, run_training, tmp_path):
    every = run_training(make_cfg("train.max_steps=4", f"output_dir={tmp_path}/every"))[1]
    second = run_training(make_cfg("train.max_steps=4", "train.log_every=2", f"output_dir={tmp_path}/second"))[1]
    assert [m["step"] for m in second] == [2, 4]
    for line, (a, b) in zip(second, [every[0:2], every[2:4]]):
        assert line["trained_tokens"] == a["trained_tokens"] + b["trained_tokens"]
        mean = (a["loss"] * a["trained_tokens"] + b["loss"] * b["trained_tokens"]) / line["trained_tokens"]
        assert line["loss"] == pytest.approx(mean, rel=1e-6)  # the window's mean token loss


def test_a_skipped_non_finite_step_does_not_void_the_window_mean():
    from ftctl.training.interrupts import StepOutcome
    from ftctl.training.metrics import LogWindow

    window = LogWindow()
    for loss, tokens in ((2.0, 10), (float("nan"), 30), (4.0, 30)):
        window.add(StepOutcome(loss, 1.0, False, tokens, real_tokens=tokens, positions=tokens))
    line = window.take()
    assert line["loss"] == pytest.approx((2.0 * 10 + 4.0 * 30) / 40) and line["trained_tokens"] == 70


def test_num_threads_applies_to_the_run_only(make_cfg, run_training):
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        run_training(make_cfg("train.max_steps=1", "train.num_threads=1"))
        assert torch.get_num_threads() == 2  # the caller's setting, not the run's
    finally:
        torch.set_num_threads(before)
