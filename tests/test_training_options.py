"""The training options users reach for (issue 25): schedules checked against formulas written out here,
the optimizers beyond AdamW, schedule-free AdamW's averaged weights and exact resume, NEFTune noise,
gradient checkpointing of every k-th layer, and Liger kernels (CUDA only; refused elsewhere).
Their distributed runs are in tests/test_parallel.py's shared launch."""

from __future__ import annotations

import importlib.util
import math
from fractions import Fraction
from types import SimpleNamespace

import pytest
import torch
from safetensors.torch import load_file

from ftctl.cli import main


def losses(metrics) -> list:
    return [m["loss"] for m in metrics if "loss" in m]


def ftctl(capsys, *args):
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def train_cfg(**overrides):
    from ftctl.config.compose import compose_config

    return compose_config(["recipe=tiny_lora", *(f"train.{k}={v}" for k, v in overrides.items())]).train


# ------------------------------------------------------------------------------------------ schedules


def reference_cosine_restarts(step, total, lr, warmup, cycles, floor_ratio):
    """Warmup, then `cycles` cosines over the remaining steps, each starting again at lr and reaching the floor at
    its last step (in exact fractions; the cycles here are whole)."""
    if step < warmup:
        return lr * (step + 1) / warmup
    length = Fraction(total - warmup, cycles)  # steps per cycle
    within_cycle = (step - warmup) % length / (length - 1)
    return lr * floor_ratio + lr * (1 - floor_ratio) * (1 + math.cos(math.pi * float(within_cycle))) / 2


def reference_wsd(step, total, lr, warmup, decay_ratio, shape, floor_ratio):
    """Warmup, lr held, then the last ceil(decay_ratio × total) steps fall to the floor, the last step on it."""
    decay = math.ceil(decay_ratio * total)
    if step < warmup:
        return lr * (step + 1) / warmup
    if step < total - decay:
        return lr
    done = (step - (total - decay) + 1) / decay  # 1/decay at the decay's first step, 1 at the run's last
    if shape == "linear":
        left = 1 - done
    elif shape == "cosine":
        left = (1 + math.cos(math.pi * done)) / 2
    else:
        left = 1 - math.sqrt(done)
    return lr * floor_ratio + (lr - lr * floor_ratio) * left


def test_cosine_with_restarts_follows_its_formula_and_restarts_at_lr():
    from ftctl.training.schedule import learning_rate

    t = train_cfg(lr_scheduler="cosine_restarts", lr_cycles=3, warmup_steps=2, lr=1e-3, min_lr_ratio=0.1)
    got = [learning_rate(s, t, 32) for s in range(32)]
    assert got == pytest.approx([reference_cosine_restarts(s, 32, 1e-3, 2, 3, 0.1) for s in range(32)], rel=1e-12)
    assert [s for s in range(2, 32) if got[s] == pytest.approx(1e-3, rel=1e-12)] == [2, 12, 22]  # each cycle's start
    # Every cycle's last step is its lowest: the floor 1e-4, as a plain cosine's last step.
    assert got[11] == got[21] == got[31] == min(got[2:]) == pytest.approx(1e-4)
    # One cycle is the plain cosine.
    one, plain = train_cfg(lr_scheduler="cosine_restarts", lr_cycles=1), train_cfg(lr_scheduler="cosine")
    assert [learning_rate(s, one, 20) for s in range(20)] == [learning_rate(s, plain, 20) for s in range(20)]


@pytest.mark.parametrize("shape", ["linear", "cosine", "1-sqrt"])
def test_warmup_stable_decay_follows_its_formula(shape):
    from ftctl.training.schedule import learning_rate

    t = train_cfg(lr_scheduler="wsd", wsd_decay_ratio=0.25, wsd_decay_shape=shape, warmup_steps=3, lr=2e-3, min_lr_ratio=0.05)
    got = [learning_rate(s, t, 30) for s in range(30)]
    assert got == pytest.approx([reference_wsd(s, 30, 2e-3, 3, 0.25, shape, 0.05) for s in range(30)], rel=1e-12)
    # ceil(0.25 × 30) = 8 decay steps: lr until step 21, below it from step 22, the floor at the last.
    assert got[3:22] == [2e-3] * 19 and got[22] < 2e-3 and got[29] == pytest.approx(1e-4, rel=1e-12)


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.lr_scheduler=wsd", "train.wsd_decay_ratio=1"], "train.wsd_decay_ratio=1.0 must be in (0, 1)"),
        (["train.lr_scheduler=wsd", "train.wsd_decay_shape=sqrt"], "train.wsd_decay_shape='sqrt' is not one of linear, cosine, 1-sqrt"),
        (["train.lr_cycles=0"], "train.lr_cycles=0 must be > 0"),
        (["train.optimizer=schedule_free_adamw"], "train.optimizer=schedule_free_adamw replaces the lr decay"),
        (["train.optimizer=sgd", "train.sgd_nesterov=true"], "train.sgd_nesterov=true needs momentum"),
        (["train.optimizer=lion8bit"], "train.optimizer='lion8bit' is not one of"),
        (["train.gradient_checkpointing_every=2"], "train.gradient_checkpointing_every=2 does nothing without train.gradient_checkpointing=true"),
        (["train.neftune_alpha=-1"], "train.neftune_alpha=-1.0 must be >= 0"),
        (["train.kernels=triton"], "train.kernels='triton' is not one of ftctl, liger"),
        (["train.optimizer=adafactor", "parallel=zero2", "parallel.nproc_per_node=2"], "train.optimizer=adafactor with parallel=zero2: DeepSpeed"),
        (["train.optimizer=adafactor", "parallel=fsdp", "parallel.nproc_per_node=2"], "train.optimizer=adafactor with parallel=fsdp"),
        (["train.optimizer=lion", "parallel=fsdp", "parallel.nproc_per_node=2"], "train.optimizer=lion with parallel=fsdp: bitsandbytes"),
        (["train.optimizer=schedule_free_adamw", "train.lr_scheduler=constant", "parallel=zero1", "parallel.nproc_per_node=2"],
         "train.optimizer=schedule_free_adamw with parallel=zero1"),
    ],
)
def test_option_mistakes_are_one_line_before_anything_loads(capsys, overrides, message):
    code, _, err = ftctl(capsys, "train", "recipe=tiny_lora", *overrides, "--cfg")
    assert code == 2 and err.startswith(f"ftctl: error: {message}") and err.count("\n") == 1, err


# ---------------------------------------------------------------------------------------- optimizers


@pytest.mark.parametrize("optimizer, overrides", [
    ("adafactor", ["method=full", "train.lr=1e-2"]),  # steps relative to each weight's RMS: LoRA's zero B barely moves
    ("lion", ["train.lr=1e-3"]),
    ("lion_8bit", ["method=full", "train.lr=3e-4", "train.save_every=6"]),  # full: tensors large enough for 8-bit state
    ("sgd", ["train.lr=0.5"]),
    ("sgd", ["train.lr=0.2", "train.sgd_momentum=0.9", "train.sgd_nesterov=true", "train.save_every=6"]),
    ("schedule_free_adamw", ["train.lr_scheduler=constant"]),
])
def test_each_optimizer_trains_the_tiny_model(make_cfg, run_training, optimizer, overrides):
    result, metrics = run_training(make_cfg(f"train.optimizer={optimizer}", "train.max_steps=6", *overrides))
    curve = losses(metrics)
    assert len(curve) == 6 and sum(curve[-2:]) / 2 < curve[0] - 0.3, curve
    if "train.save_every=6" in overrides:
        state = torch.load(result.run_dir / "checkpoints" / "step-6" / "optimizer.rank0.pt", weights_only=False)["optimizer"]
        if optimizer == "lion_8bit":  # 8-bit blocks for the large tensors (bitsandbytes nests them in its state dict)
            kept = [s.get("__bnb_optimizer_quant_state__", s) for s in state["state"].values()]
            assert {str(s["state1"].dtype) for s in kept if s["state1"].numel() >= 4096} == {"torch.uint8"}
            assert {str(s["state1"].dtype) for s in kept if s["state1"].numel() < 4096} == {"torch.float32"}
        else:  # SGD's Nesterov momentum is what it keeps
            assert state["param_groups"][0]["nesterov"] is True and state["param_groups"][0]["momentum"] == 0.9
            assert all(s["momentum_buffer"].abs().sum() > 0 for s in state["state"].values())


def test_a_bitsandbytes_optimizer_without_a_kernel_for_the_device_is_one_line(monkeypatch):
    from ftctl.errors import ConfigError
    from ftctl.training.optimizers import _check_bitsandbytes_runs

    class NoKernelHere(torch.optim.SGD):
        def step(self, closure=None):
            raise NotImplementedError("Could not run 'bitsandbytes::optimizer_update_8bit_blockwise' with arguments from the 'XPU' backend")

    with pytest.raises(ConfigError, match=r"train.optimizer=lion_8bit: bitsandbytes has no NoKernelHere for cpu here \(Could not run"):
        _check_bitsandbytes_runs(NoKernelHere, "lion_8bit", torch.device("cpu"))
    import bitsandbytes.optim

    _check_bitsandbytes_runs(bitsandbytes.optim.Lion8bit, "lion_8bit", torch.device("cpu"))  # the real one runs here


def test_the_estimate_counts_each_optimizers_state_and_checkpointing_every_kth_layer():
    from ftctl.config.compose import compose_config
    from ftctl.estimate import estimate_for

    def estimate(*overrides):
        return estimate_for(compose_config(["recipe=llama7b_full", "precision=bf16", *overrides]))

    adamw = estimate()
    n, hidden = adamw.trainable_parameters, 4096
    assert adamw.optimizer_bytes == 8 * n
    assert estimate("train.optimizer=schedule_free_adamw", "train.lr_scheduler=constant").optimizer_bytes == 8 * n  # z and v
    assert estimate("train.optimizer=sgd").optimizer_bytes == 0
    assert estimate("train.optimizer=sgd", "train.sgd_momentum=0.9").optimizer_bytes == 4 * n
    assert estimate("train.optimizer=lion").optimizer_bytes == 4 * n
    assert estimate("train.optimizer=lion_8bit").optimizer_bytes == pytest.approx(n * (1 + 4 / 256), rel=1e-3)  # a byte, plus an fp32 scale per 256-value block
    assert estimate("train.optimizer=adafactor").optimizer_bytes == pytest.approx(n * 4 * 2 / hidden)  # a row and a column
    # Every 2nd of 32 layers: 16 keep only their input, 16 keep all they keep without checkpointing.
    all_layers, every_2nd = adamw.activations_with_checkpointing_bytes, estimate("train.gradient_checkpointing_every=2")
    without = adamw.activations_without_checkpointing_bytes
    layer_input = 2 * 1024 * hidden * 4  # micro-batch 2 × 1024 tokens × hidden, the fp32 residual stream of full fine-tuning
    # without - all_layers = 32 layers' activations - 32 inputs - the one layer recomputed (1/32 of the layers)
    layers = (without - all_layers + 32 * layer_input) * 32 / 31
    assert every_2nd.activations_with_checkpointing_bytes == pytest.approx(all_layers - 16 * layer_input + layers / 2, rel=1e-12)
    assert all_layers < every_2nd.activations_with_checkpointing_bytes < without


def _eval_loss_of(model, cfg, model_dir) -> float:
    """The eval split's mean token loss of ``model`` as it stands, through the runner's own evaluate."""
    from ftctl.data.batching import Batching
    from ftctl.data.dataset import build_datasets
    from ftctl.models.loading import load_tokenizer
    from ftctl.precision.policy import resolve_precision
    from ftctl.training.runner import evaluate

    tokenizer = load_tokenizer(cfg.model, str(model_dir))
    _, eval_data = build_datasets(cfg.data, tokenizer, cfg.seed)
    from ftctl.parallel.base import TorchEngine

    backend = SimpleNamespace(rank=0, world_size=1, dp_rank=0, dp_size=1, device=torch.device("cpu"), all_reduce_sum=lambda x: x)
    precision = resolve_precision(cfg.precision, backend.device)
    engine = TorchEngine(model, None, precision)
    loss, _ = evaluate(engine, eval_data, Batching.from_config(cfg, tokenizer.pad_token_id), backend, precision)
    return loss


def test_schedule_free_evaluates_and_saves_its_average_and_resumes_exactly(make_cfg, run_training, tmp_path, tiny_model_dir):
    """Training runs at schedule-free's y, evaluation, checkpoints and the result hold its average x, and
    neither switch nor a resume changes the training: the same losses and weights, bit for bit."""
    common = ["train.optimizer=schedule_free_adamw", "train.lr_scheduler=constant", "data.eval_fraction=0.25"]
    checkpointed = make_cfg(*common, "train.max_steps=4", "train.save_every=2", "train.eval_every=2", f"output_dir={tmp_path}/a")
    result, metrics = run_training(checkpointed)
    _, plain = run_training(make_cfg(*common, "train.max_steps=4", f"output_dir={tmp_path}/b"))
    assert losses(metrics) == losses(plain)  # switching weights for eval and checkpoints leaves training exact

    final = load_file(result.final_dir / "adapter_model.safetensors")
    step4 = result.run_dir / "checkpoints" / "step-4"
    assert load_file(step4 / "adapter_model.safetensors").keys() == final.keys()
    for key, tensor in load_file(step4 / "adapter_model.safetensors").items():
        assert torch.equal(tensor, final[key]), key  # a checkpoint's loadable weights are the average, as the result
    # ... and its optimizer state carries the trained point y, which differs from the average.
    state = torch.load(step4 / "optimizer.rank0.pt", weights_only=False)["optimizer"]
    y = [s["y"] for s in state["state"].values()]
    assert len(y) == len(final) and all(s["z"].shape == s["y"].shape for s in state["state"].values())
    assert sorted(float(v.abs().sum()) for v in y) != pytest.approx(sorted(float(v.abs().sum()) for v in final.values()))

    # Evaluation saw the average: the last eval loss is the saved result's.
    last_eval = [m["eval_loss"] for m in metrics if "eval_loss" in m][-1]
    assert _eval_loss_of(result.model, checkpointed, tiny_model_dir) == pytest.approx(last_eval, rel=1e-6)

    run_training(make_cfg(*common, "train.max_steps=2", "train.save_every=2", "train.eval_every=2", f"output_dir={tmp_path}/c"))
    resumed, resumed_metrics = run_training(make_cfg(*common, "train.max_steps=4", "train.save_every=2", "train.eval_every=2",
                                                     f"output_dir={tmp_path}/c", "resume=auto"))
    assert losses(resumed_metrics) == losses(metrics)
    assert [m["eval_loss"] for m in resumed_metrics if "eval_loss" in m] == [m["eval_loss"] for m in metrics if "eval_loss" in m]
    assert (resumed.final_dir / "adapter_model.safetensors").read_bytes() == (result.final_dir / "adapter_model.safetensors").read_bytes()


# ------------------------------------------------------------------------------------------- NEFTune


def test_neftune_noise_has_the_papers_magnitude_in_training_and_none_in_eval(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    from ftctl.models.neftune import add_neftune_noise

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    handle = add_neftune_noise(model, alpha=5.0)
    seen = []
    model.get_input_embeddings().register_forward_hook(lambda module, args, output: seen.append(output.detach()))
    input_ids = torch.randint(0, model.config.vocab_size, (4, 48), generator=torch.Generator().manual_seed(0))
    clean = model.get_input_embeddings().weight[input_ids].detach()
    magnitude = 5.0 / math.sqrt(48 * model.config.hidden_size)  # alpha / sqrt(L · d)

    model.train()
    model(input_ids=input_ids)
    noise = seen[-1] - clean
    assert noise.abs().max() <= magnitude * (1 + 1e-5) and noise.abs().max() > 0.99 * magnitude
    # Uniform on [-m, m]: mean 0, standard deviation m / sqrt(3) (12288 draws: a few percent of noise).
    assert abs(float(noise.mean())) < 0.05 * magnitude
    assert float(noise.std()) == pytest.approx(magnitude / math.sqrt(3), rel=0.05)

    model.eval()
    model(input_ids=input_ids)
    assert torch.equal(seen[-1], clean)
    handle.remove()
    model.train()
    model(input_ids=input_ids)
    assert torch.equal(seen[-1], clean)


def test_neftune_in_a_run_trains_noisy_and_evaluates_clean(make_cfg, run_training, tmp_path, tiny_model_dir):
    common = ["train.max_steps=2", "data.eval_fraction=0.25"]
    _, clean_metrics = run_training(make_cfg(*common, f"output_dir={tmp_path}/clean"))
    cfg = make_cfg(*common, "train.neftune_alpha=5", f"output_dir={tmp_path}/noisy")
    result, metrics = run_training(cfg)
    assert losses(metrics)[0] != losses(clean_metrics)[0]  # the very first forward already trains on noisy embeddings
    embeddings = result.model.get_input_embeddings()
    assert embeddings._forward_hooks, "the run's model carries the NEFTune hook"
    eval_loss = [m["eval_loss"] for m in metrics if "eval_loss" in m][-1]
    embeddings._forward_hooks.clear()  # without the hook: what a clean evaluation of these weights gives
    assert _eval_loss_of(result.model, cfg, tiny_model_dir) == pytest.approx(eval_loss, rel=1e-6)


# ------------------------------------------------------------------------- checkpointing every k layers


def test_checkpointing_every_k_layers_recomputes_exactly_those_and_changes_no_gradient():
    import copy

    from transformers import LlamaConfig, LlamaForCausalLM

    from ftctl.models.checkpointing import checkpointable_layers, enable_activation_checkpointing

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=128, hidden_size=32, intermediate_size=64, num_hidden_layers=5, num_attention_heads=4,
                         num_key_value_heads=2, initializer_range=0.1)
    plain = LlamaForCausalLM(config).train()
    every2 = copy.deepcopy(plain)
    assert enable_activation_checkpointing(every2, every=2) == [0, 2, 4]

    mlp_calls = [0] * 5
    for i, layer in enumerate(checkpointable_layers(every2)):
        # A hook inside the layer, which the recompute in backward runs again (a pre-hook: torch stops a
        # recompute as soon as it has every saved tensor back, before the MLP's output hook would run).
        layer.mlp.register_forward_pre_hook(lambda module, args, i=i: mlp_calls.__setitem__(i, mlp_calls[i] + 1))
    input_ids = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(1))
    results = []
    for model in (plain, every2):
        loss = model(input_ids=input_ids, labels=input_ids, use_cache=False).loss
        loss.backward()
        results.append((loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}))
    assert mlp_calls == [2, 1, 2, 1, 2]
    torch.testing.assert_close(results[1][0], results[0][0], rtol=0, atol=0)
    for name, grad in results[0][1].items():
        torch.testing.assert_close(results[1][1][name], grad, rtol=1e-6, atol=1e-7, msg=name)


def test_a_run_checkpoints_every_kth_layer(make_cfg, run_training):
    result, metrics = run_training(make_cfg("train.max_steps=2", "train.gradient_checkpointing=true",
                                            "train.gradient_checkpointing_every=2"))
    from ftctl.models.checkpointing import checkpointable_layers

    assert [layer.gradient_checkpointing for layer in checkpointable_layers(result.model)] == [True, False]
    assert len(losses(metrics)) == 2


# ----------------------------------------------------------------------------------------------- Liger


def test_liger_is_refused_in_one_line_on_cpu_and_without_the_package(capsys, monkeypatch):
    from ftctl.parallel import support

    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # what `ftctl train` would do on this machine's CPU
    code, _, err = ftctl(capsys, "train", "recipe=tiny_lora", "precision=fp32", "train.kernels=liger", "--dry-run")
    assert code == 2 and err == ("ftctl: error: train.kernels=liger runs liger-kernel's Triton kernels, which need a CUDA "
                                 "GPU; on CPU use train.kernels=ftctl (the default)\n")
    monkeypatch.setattr(support.importlib.util, "find_spec", lambda name: None)
    assert support.kernels_refusal("liger", "cuda") == (
        "train.kernels=liger needs liger-kernel, which is not installed: pip install 'ftctl[liger]'")
    assert support.kernels_refusal("ftctl", "cpu") is None


def test_the_loss_uses_the_kernel_the_head_carries(tiny_model_dir):
    """The seam train.kernels=liger goes through, with a stand-in kernel: the head's loss is the kernel's."""
    from transformers import AutoModelForCausalLM

    from ftctl.models.kernels import HEAD_LOSS_KERNEL
    from ftctl.training.loss import linear_cross_entropy_sum, token_loss_sum

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    ids = torch.randint(0, model.config.vocab_size, (2, 12), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[:, :4] = -100
    batch = SimpleNamespace(labels=labels, loss_positions=None, loss_targets=None,
                            model_inputs=lambda device, packed_kernel=None: {"input_ids": ids})
    calls = []

    def kernel(hidden, weight, bias, targets):
        calls.append(hidden.shape[0])
        return linear_cross_entropy_sum(hidden, weight, bias, targets) * 2

    ftctl_loss = token_loss_sum(model, batch, torch.device("cpu"))
    model.get_output_embeddings().__dict__[HEAD_LOSS_KERNEL] = kernel
    assert float(token_loss_sum(model, batch, torch.device("cpu"))) == pytest.approx(2 * float(ftctl_loss), rel=1e-6)
    assert calls == [2 * 8]  # only the trained positions reach it: those whose next token has a label


@pytest.mark.skipif(not (torch.cuda.is_available() and importlib.util.find_spec("liger_kernel")), reason="needs CUDA and liger-kernel")
def test_liger_kernels_train_on_cuda_like_ftctls(make_cfg, run_training, tmp_path, caplog):
    """Liger's own apply function replaces the norms, MLPs and rotary embedding, liger's fused linear
    cross-entropy computes the loss, and the run's losses follow ftctl's kernels' within bf16 rounding."""
    import logging

    from transformers.models.llama import modeling_llama

    from ftctl.models.kernels import HEAD_LOSS_KERNEL, liger_linear_cross_entropy_sum

    common = ["train.max_steps=6", "precision=bf16", "data.packing=true"]
    _, reference = run_training(make_cfg(*common, f"output_dir={tmp_path}/ftctl"))
    with caplog.at_level(logging.INFO, logger="ftctl"):
        result, metrics = run_training(make_cfg(*common, "train.kernels=liger", f"output_dir={tmp_path}/liger"))
    assert "liger kernels on llama: rope, rms_norm, swiglu (LigerRMSNorm, LigerSwiGLUMLP)" in caplog.text
    base = result.model.get_base_model()
    names = {type(m).__name__: m._get_name() for m in base.modules()}
    assert names["LlamaRMSNorm"] == "LigerRMSNorm" and names["LlamaMLP"] == "LigerSwiGLUMLP"
    assert modeling_llama.apply_rotary_pos_emb.__module__.startswith("liger_kernel")
    assert base.get_output_embeddings().__dict__[HEAD_LOSS_KERNEL] is liger_linear_cross_entropy_sum
    assert losses(metrics) == pytest.approx(losses(reference), rel=2e-2)
    assert losses(metrics)[-1] < losses(metrics)[0] - 0.3

    # The fused loss equals ftctl's chunked one, gradients included (fp32).
    from ftctl.training.loss import LinearCrossEntropy

    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(37, 64, device="cuda", generator=g, requires_grad=True)
    weight = torch.randn(512, 64, device="cuda", generator=g, requires_grad=True)
    targets = torch.randint(0, 512, (37,), device="cuda", generator=g)
    fused = liger_linear_cross_entropy_sum(hidden, weight, None, targets)
    grads = torch.autograd.grad(fused, (hidden, weight))
    ours = LinearCrossEntropy.apply(hidden, weight, None, targets, True)
    torch.testing.assert_close(fused, ours, rtol=1e-4, atol=1e-4)
    for got, want in zip(grads, torch.autograd.grad(ours, (hidden, weight))):
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
