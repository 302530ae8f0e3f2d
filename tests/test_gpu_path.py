"""The CUDA hot path, checked where it can be on a CPU: one kernel seam for packed attention, the
packed loss equal to the padded one on every kernel that runs here, no host reads of device values
inside the micro-batch loop, batches built ahead in the same order, peak memory in the metrics,
regional compilation. The test marked for CUDA runs the loop under torch's sync debug mode."""

from __future__ import annotations


import numpy as np
import pytest

from ftctl.data.batching import collate, pack_examples
from ftctl.data.render import IGNORE_INDEX

COMMON = ("precision=fp32", "train.max_steps=2", "train.micro_batch_size=2", "train.global_batch_size=4",
          "data.max_seq_len=128")


def _examples(seed=4):
    rng = np.random.default_rng(seed)
    out = []
    for n, prompt in ((30, 10), (17, 3), (45, 20), (9, 2), (22, 5)):
        ids = rng.integers(10, 500, n)
        labels = ids.copy()
        labels[:prompt] = IGNORE_INDEX
        out.append((ids, labels))
    return out


def test_kernel_choice_follows_capabilities():
    from ftctl.errors import ConfigError
    from ftctl.models.packed_attention import KernelCapabilities, choose_packed_kernel

    def caps(device="cuda", flash=False, varlen=False, flex=False):
        return KernelCapabilities(device, flash_attn=flash, torch_varlen=varlen, flex=flex)

    assert choose_packed_kernel(caps(flash=True, varlen=True, flex=True)) == "flash_varlen"
    assert choose_packed_kernel(caps(varlen=True, flex=True)) == "varlen"
    assert choose_packed_kernel(caps(flex=True)) == "flex"
    assert choose_packed_kernel(caps()) == "sdpa"
    # The CPU keeps per-example SDPA whatever is installed.
    assert choose_packed_kernel(caps("cpu", flash=True, varlen=True, flex=True)) == "sdpa"
    assert choose_packed_kernel(caps(flash=True, varlen=True), "sdpa") == "sdpa"
    assert choose_packed_kernel(caps(varlen=True), "varlen") == "varlen"
    with pytest.raises(ConfigError, match="data.packed_attention=flash_varlen needs CUDA and flash-attn"):
        choose_packed_kernel(caps(varlen=True), "flash_varlen")
    with pytest.raises(ConfigError, match="data.packed_attention=flex"):
        choose_packed_kernel(caps("cpu", flex=True), "flex")
    assert choose_packed_kernel(KernelCapabilities.probe("cpu")) == "sdpa"


def test_collator_gives_boundaries_as_host_ints():
    batch = pack_examples(_examples(), row_len=64, pad_token_id=0)
    bounds = batch.cu_seq_lens.tolist()
    flat = [n for row in batch.row_lengths for n in row]
    assert bounds == list(np.concatenate([[0], np.cumsum(flat)]))
    assert batch.longest_span == max(flat) and isinstance(batch.longest_span, int)
    assert all(sum(row) == batch.input_ids.shape[1] for row in batch.row_lengths)
    assert str(batch.cu_seq_lens.dtype) == "torch.int32"
    # The trained positions and their targets, from the host labels.
    targets = np.full(batch.labels.shape, IGNORE_INDEX)
    targets[:, :-1] = batch.labels.numpy()[:, 1:]
    assert batch.loss_positions.tolist() == list(np.flatnonzero(targets.reshape(-1) != IGNORE_INDEX))
    assert batch.loss_targets.tolist() == list(targets.reshape(-1)[targets.reshape(-1) != IGNORE_INDEX])
    assert len(batch.loss_positions) == batch.trained_tokens


@pytest.mark.parametrize("kernel", ["sdpa", "flex"])
def test_packed_loss_equals_padded_on_every_cpu_kernel(tiny_model_dir, kernel):
    """Per-example SDPA (loss and gradients) and FlexAttention with the document mask (forward: it has
    no CPU backward) give the loss of the padded batch; the layers get the boundaries as host ints."""
    import torch
    from transformers import AutoModelForCausalLM

    from ftctl.models import packed_attention
    from ftctl.training.loss import token_loss_sum

    examples = _examples()
    results = []
    for packed in (False, True):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa")
        batch = collate(examples, 0)
        if packed:
            assert packed_attention.use_packed_attention(model, kernel)
            assert packed_attention.packed_kernel_of(model) == kernel
            batch = pack_examples(examples, 64, 0)
        grad = kernel == "sdpa"
        with torch.set_grad_enabled(grad):
            loss = token_loss_sum(model, batch, torch.device("cpu"))
        if grad:
            loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()} if grad else {}))
    (padded_loss, padded_grads), (packed_loss, packed_grads) = results
    torch.testing.assert_close(packed_loss, padded_loss, rtol=1e-5, atol=1e-5)
    for name, grad in padded_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)


class HostReads:
    """Counts reads of tensor values by the host: scalar reads (item, bool, float, int), nonzero and
    boolean-mask selection (their size depends on values), tolist, numpy, cpu."""

    OPS = ("_local_scalar_dense", "nonzero", "masked_select", "equal", "is_nonzero")

    def __init__(self):
        import torch
        from torch.utils._python_dispatch import TorchDispatchMode

        self.seen = []
        seen = self.seen

        class Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                name = func.__name__.split(".")[0]
                bool_index = name == "index" and any(
                    isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] if len(args) > 1 else []) or []
                )
                if name in HostReads.OPS or bool_index:
                    seen.append(func.__name__)
                return func(*args, **(kwargs or {}))

        self.mode = Mode()
        self.active = False

    def start(self):
        if not self.active:
            self.active = True
            self.mode.__enter__()

    def stop(self):
        if self.active:
            self.active = False
            self.mode.__exit__(None, None, None)


@pytest.fixture
def micro_batch_loop_watch(monkeypatch):
    """Watches from the first micro-batch's forward to the optimizer step, in every training step."""
    import torch

    from ftctl.parallel.base import TorchEngine

    watch = HostReads()
    accumulating, step = TorchEngine.accumulating, TorchEngine.step

    def watched_accumulating(self, last_micro_batch):
        watch.start()
        return accumulating(self, last_micro_batch)

    def watched_step(self, max_grad_norm):
        watch.stop()
        return step(self, max_grad_norm)

    monkeypatch.setattr(TorchEngine, "accumulating", watched_accumulating)
    monkeypatch.setattr(TorchEngine, "step", watched_step)
    for method in ("tolist", "numpy", "cpu", "item"):
        real = getattr(torch.Tensor, method)

        def counted(self, *a, _real=real, _name=method, **k):
            if watch.active:
                watch.seen.append(_name)
            return _real(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, method, counted)
    yield watch
    watch.stop()


def test_micro_batch_loop_reads_nothing_back(make_cfg, run_training, micro_batch_loop_watch):
    """The CPU proof of "no host sync in the micro-batch loop": no value of a tensor is read by the
    host between the first forward of a packed step and its optimizer step (two micro-batches per step).

    Padded batches are not held to it: transformers checks their padding mask on the device
    (``padding_mask.all()``) once per forward while building the attention mask."""
    _, metrics = run_training(make_cfg(*COMMON, "data.packing=true"))
    assert [m["step"] for m in metrics if "loss" in m] == [1, 2]
    assert micro_batch_loop_watch.seen == []


def test_the_watch_sees_a_host_read(make_cfg, run_training, micro_batch_loop_watch, monkeypatch):
    """The watch above can fail: the loss read back per micro-batch, as the loop once did, is seen."""
    from ftctl.training import runner

    real = runner.token_loss_sum

    def reads_back(module, batch, device):
        loss = real(module, batch, device)
        loss.detach().double().cpu()
        float(loss)
        return loss

    monkeypatch.setattr(runner, "token_loss_sum", reads_back)
    run_training(make_cfg(*COMMON, "data.packing=true"))
    assert "cpu" in micro_batch_loop_watch.seen and "_local_scalar_dense.default" in micro_batch_loop_watch.seen


def test_packed_attention_reads_no_boundary_back(tiny_model_dir, monkeypatch):
    """The layers take the collator's host ints; the old per-layer ``cu_seq_lens.tolist()`` is gone."""
    import torch
    from transformers import AutoModelForCausalLM

    from ftctl.models import packed_attention
    from ftctl.training.loss import returns_head_output, token_loss_sum

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa")
    assert packed_attention.use_packed_attention(model, "sdpa")
    returns_head_output(model)  # the runner's one-off probe before training, not part of a step
    calls = []
    monkeypatch.setattr(packed_attention, "example_spans", lambda *a: calls.append(a) or [])
    watch = HostReads()
    watch.start()
    try:
        with torch.no_grad():
            token_loss_sum(model, pack_examples(_examples(), 64, 0), torch.device("cpu"))
    finally:
        watch.stop()
    assert calls == [] and watch.seen == []


def test_batches_built_ahead_are_the_loops_own():
    from ftctl.data.prefetch import StepBatches

    built = []

    def build(step):
        built.append(step)
        return [step * 10 + i for i in range(3)]

    with StepBatches(build, range(2, 7), depth=2) as upcoming:
        assert list(upcoming) == [(s, [s * 10, s * 10 + 1, s * 10 + 2]) for s in range(2, 7)]

    def broken(step):
        if step == 1:
            raise ValueError("bad record")
        return [step]

    with StepBatches(broken, range(0, 5)) as upcoming:
        got = []
        with pytest.raises(ValueError, match="bad record"):
            for item in upcoming:
                got.append(item)
        assert got == [(0, [0])]

    slow_steps = []
    upcoming = StepBatches(lambda s: slow_steps.append(s) or [s], range(0, 1000), depth=1)
    next(iter(upcoming))
    upcoming.close()  # a stopped run does not leave the thread building the remaining steps
    assert not upcoming._thread.is_alive() and len(slow_steps) < 10


def test_metrics_carry_peak_memory_and_the_log_names_the_kernel(make_cfg, run_training, caplog):
    import logging

    with caplog.at_level(logging.INFO, logger="ftctl"):
        _, metrics = run_training(make_cfg(*COMMON, "data.packing=true", "train.log_every=1"))
    lines = [m for m in metrics if "loss" in m]
    import torch

    key = "mem_peak_alloc_gib" if torch.cuda.is_available() else "mem_peak_rss_gib"
    assert all(0.01 < m[key] < 1024 for m in lines)
    assert "packed attention: sdpa kernel on cpu" in caplog.text or torch.cuda.is_available()


def test_memory_peaks_reset_per_window_on_cuda(monkeypatch):
    """On a GPU the window reports the allocator's peaks and resets them; faked here, real under CUDA."""
    import torch

    from ftctl.training import metrics

    resets = []
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda d=None: 3 * 2**30)
    monkeypatch.setattr(torch.cuda, "max_memory_reserved", lambda d=None: 4 * 2**30)
    monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda d=None: resets.append(d))
    assert metrics.memory_peaks("cuda:0") == {"mem_peak_alloc_gib": 3.0, "mem_peak_reserved_gib": 4.0}
    assert len(resets) == 1
    assert set(metrics.memory_peaks("cpu")) == {"mem_peak_rss_gib"}


@pytest.mark.slow
def test_regional_compile_trains_like_eager(make_cfg, run_training, monkeypatch):
    """Dynamo's capture of each layer, run by the eager backend (inductor's C++ code generation takes
    minutes on a CPU; scripts/gpu_measure.py measures inductor itself on the GPU)."""
    import torch

    from ftctl.models import compile as regional
    from ftctl.models.compile import decoder_layers

    monkeypatch.setattr(regional, "COMPILE_BACKEND", "eager")
    one_step = (*COMMON, "train.max_steps=1")
    _, eager = run_training(make_cfg(*one_step))
    result, compiled = run_training(make_cfg(*one_step, "train.compile=true", "overwrite=true"))
    layers = decoder_layers(result.model)
    assert len(layers) == 2 and all(getattr(layer, "_compiled_call_impl", None) is not None for layer in layers)
    # Parameter names are the eager model's: checkpoints and adapters load either way.
    assert not any("_orig_mod" in name for name, _ in result.model.named_parameters())
    eager, compiled = [m for m in eager if "loss" in m], [m for m in compiled if "loss" in m]
    assert len(eager) == len(compiled) == 1
    for a, b in zip(eager, compiled):
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4) and b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-3)
    torch._dynamo.reset()


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU: runs the loop under torch.cuda.set_sync_debug_mode('error')")
def test_cuda_micro_batch_loop_never_syncs(make_cfg, run_training, monkeypatch):
    import torch

    from ftctl.parallel.base import TorchEngine

    accumulating, step = TorchEngine.accumulating, TorchEngine.step

    def strict_accumulating(self, last_micro_batch):
        torch.cuda.set_sync_debug_mode("error")
        return accumulating(self, last_micro_batch)

    def relaxed_step(self, max_grad_norm):
        torch.cuda.set_sync_debug_mode("default")
        return step(self, max_grad_norm)

    monkeypatch.setattr(TorchEngine, "accumulating", strict_accumulating)
    monkeypatch.setattr(TorchEngine, "step", relaxed_step)
    try:
        _, metrics = run_training(make_cfg(*COMMON, "data.packing=true", "precision=bf16"))
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert [m["step"] for m in metrics if "loss" in m] == [1, 2]
    assert all(m["mem_peak_alloc_gib"] > 0 for m in metrics if "loss" in m)


def _saved_bytes_per_layer(make_cfg, method: str):
    """Bytes autograd keeps per decoder layer under bf16 autocast, with their dtypes; and the frozen weights' dtypes."""
    from saved_tensors import saved_by_decoder_layer

    saved = saved_by_decoder_layer(make_cfg(f"method={method}", "method.r=4", "method.dropout=0.0", "precision=bf16",
                                            "data.packing=true"))
    frozen = {p.dtype for p in saved.model.parameters() if not p.requires_grad and p.dtype.is_floating_point}
    return list(zip(saved.bytes_per_layer(), saved.dtypes_per_layer())), frozen


def test_qlora_keeps_no_more_for_backward_than_lora(make_cfg):
    """QLoRA's unquantised weights (embeddings, norms) used to be upcast to fp32 by peft's k-bit
    preparation, which made the residual stream and every layer's saved activations fp32 (plus the
    bf16 copies autocast makes for the matmuls): QLoRA held more than LoRA at the same batch. Now a
    QLoRA layer keeps exactly what a LoRA layer keeps, and the estimate says so too."""
    import torch

    from ftctl.config.compose import compose_config
    from ftctl.estimate import estimate_for

    lora, lora_frozen = _saved_bytes_per_layer(make_cfg, "lora")
    qlora, qlora_frozen = _saved_bytes_per_layer(make_cfg, "qlora")
    assert qlora_frozen == lora_frozen == {torch.bfloat16}
    assert [n for n, _ in qlora] == [n for n, _ in lora] and all(n > 0 for n, _ in lora)

    def estimate(method):
        return estimate_for(compose_config([f"recipe=llama7b_{method}", "precision=bf16", "train.micro_batch_size=8",
                                            "method.r=16", "method.dropout=0.05", "method.target_modules=[all-linear]",
                                            "data.max_seq_len=2048", "train.gradient_checkpointing=false"]))

    e_lora, e_qlora = estimate("lora"), estimate("qlora")
    assert e_qlora.activations_bytes == e_lora.activations_bytes
    assert e_qlora.total_bytes < e_lora.total_bytes


def test_full_bf16_keeps_a_compute_copy_of_every_linear_weight_and_the_estimate_counts_it(make_cfg):
    """Under autocast, full fine-tuning casts each fp32 master weight to bf16 for its matmul and backward
    keeps that copy: one bf16 copy of the decoder's linear weights per layer, which the estimate adds."""
    import torch

    from ftctl.estimate import estimate_for
    from ftctl.methods import create_method
    from ftctl.models.architecture import Architecture
    from ftctl.models.loading import model_config_dict
    from ftctl.precision.policy import resolve_precision

    cfg = make_cfg("method=full", "precision=bf16")
    precision = resolve_precision(cfg.precision, torch.device("cpu"))
    model = create_method(cfg).build_model(cfg.model.name_or_path, precision, torch.device("cpu")).train()
    layers = [m for m in model.modules() if type(m).__name__ == "LlamaDecoderLayer"]
    shapes = {tuple(p.shape) for name, p in layers[0].named_parameters() if p.ndim == 2}
    saved = {}

    def keep(t):
        if t.dtype == torch.bfloat16 and tuple(t.shape) in shapes | {s[::-1] for s in shapes}:
            saved[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    batch = collate(_examples(), 0)
    with torch.autograd.graph.saved_tensors_hooks(keep, lambda t: t), precision.autocast():
        model(**batch.model_inputs("cpu"))
    arch = Architecture.from_config(model_config_dict(cfg.model.name_or_path))
    layer_linear = sum(i * o for i, o, _ in arch.linear_shapes().values())
    assert sum(saved.values()) == arch.layers * layer_linear * 2

    # The estimate: what autograd keeps for the activations, plus exactly these copies.
    from ftctl.estimate import activation_bytes

    est = estimate_for(cfg)
    tokens = cfg.train.micro_batch_size * cfg.data.max_seq_len
    without_copies = activation_bytes(arch, cfg, set(), tokens, 4, 2)[0]
    assert est.activations_without_checkpointing_bytes == round(without_copies + arch.layers * layer_linear * 2)
    fp32 = estimate_for(make_cfg("method=full", "precision=fp32"))
    assert fp32.activations_without_checkpointing_bytes == round(activation_bytes(arch, cfg, set(), tokens, 4, 4)[0])


def test_a_kernel_the_machine_lacks_is_refused_before_the_model_loads(make_cfg, run_training, monkeypatch):
    import torch

    from ftctl.errors import ConfigError
    from ftctl.training import runner

    if torch.cuda.is_available():
        pytest.skip("on a GPU flex is available")
    monkeypatch.setattr(runner, "create_method", lambda cfg: pytest.fail("the model was built"))
    with pytest.raises(ConfigError, match="data.packed_attention=flex needs CUDA"):
        run_training(make_cfg(*COMMON, "data.packing=true", "data.packed_attention=flex"))
