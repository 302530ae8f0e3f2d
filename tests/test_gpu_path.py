"""The CUDA hot path, checked where it can be on a CPU: one kernel seam for packed attention, the
packed loss equal to the padded one on every kernel that runs here, no host reads of device values
inside the micro-batch loop, batches built ahead in the same order, peak memory in the metrics,
regional compilation. The test marked for CUDA runs the loop under torch's sync debug mode."""

from __future__ import annotations

import functools
import re

import numpy as np
import pytest

from ftctl.data.batching import collate, pack_examples
from ftctl.data.render import IGNORE_INDEX

COMMON = ("precision=fp32", "train.max_steps=2", "train.micro_batch_size=2", "train.global_batch_size=4",
          "data.max_seq_len=128")
# The step's one reduction and one read hold for every objective: DPO and KTO add their reward and log-prob sums to
# it (KTO's KL estimate is a collective before the micro-batches, read by nobody); the reference is the training
# model with its adapter off.
OBJECTIVES = {"sft": (), "dpo": ("objective=dpo", "data=preference_sample"), "kto": ("objective=kto", "data=kto_sample")}


def _examples(seed=4):
    rng = np.random.default_rng(seed)
    out = []
    for n, prompt in ((30, 10), (17, 3), (45, 20), (9, 2), (22, 5)):
        ids = rng.integers(10, 500, n)
        labels = ids.copy()
        labels[:prompt] = IGNORE_INDEX
        out.append((ids, labels))
    return out


def _caps(device="cuda", flash=False, varlen=False, flex=False):
    from ftctl.models.packed_attention import KernelCapabilities

    return KernelCapabilities(device, flash_attn=flash, torch_varlen=varlen, flex=flex)


def test_kernel_choice_follows_capabilities_and_precision():
    from ftctl.errors import ConfigError
    from ftctl.models.attention_choice import choose_packed_kernel
    from ftctl.models.packed_attention import KernelCapabilities

    def choose(caps, requested="auto", precision="bf16", dropout=0.0):
        return choose_packed_kernel(caps, requested, precision=precision, dropout=dropout)[0]

    everything = _caps(flash=True, varlen=True, flex=True)
    assert choose(everything) == "flash_varlen"
    assert choose(_caps(varlen=True, flex=True)) == "varlen"
    assert choose(_caps(flex=True)) == "flex"
    assert choose(_caps()) == "sdpa"
    # The CPU keeps per-example SDPA whatever is installed.
    assert choose(_caps("cpu", flash=True, varlen=True, flex=True)) == "sdpa"
    assert choose(_caps(flash=True, varlen=True), "sdpa") == "sdpa"
    assert choose(_caps(varlen=True), "varlen") == "varlen"
    # fp32: the varlen kernels take only fp16/bf16, so auto falls to flex (or SDPA) and says why.
    kernel, passed = choose_packed_kernel(everything, precision="fp32")
    assert kernel == "flex" and passed == ("flash_varlen passed over: it takes only fp16/bf16 inputs and precision is fp32",
                                           "varlen passed over: it takes only fp16/bf16 inputs and precision is fp32")
    assert choose(_caps(flash=True, varlen=True), precision="fp32") == "sdpa"
    assert choose(everything, precision="fp16") == "flash_varlen"
    # Attention dropout: flash-attn and SDPA take it, torch's varlen and flex do not.
    assert choose(_caps(varlen=True, flex=True), dropout=0.1) == "sdpa"
    assert choose(everything, dropout=0.1) == "flash_varlen"
    with pytest.raises(ConfigError, match=r"^data.packed_attention=flash_varlen needs CUDA and flash-attn; use "
                                          r"data.packed_attention=auto \(it picks varlen here\)$"):
        choose(_caps(varlen=True), "flash_varlen")
    with pytest.raises(ConfigError, match=r"^data.packed_attention=varlen takes only fp16/bf16 inputs and precision is "
                                          r"fp32; use precision=bf16, or data.packed_attention=auto \(it picks flex here\)$"):
        choose(everything, "varlen", precision="fp32")
    with pytest.raises(ConfigError, match="data.packed_attention=flex needs CUDA"):
        choose(_caps("cpu", flex=True), "flex")
    assert choose(KernelCapabilities.probe("cpu")) == "sdpa"


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


def _kernel_cases():
    """Every packed kernel on the devices it runs on: the CPU's here, the CUDA ones skipped with what they need."""
    import torch

    from ftctl.models.packed_attention import KERNEL_NEEDS, KernelCapabilities

    cases = [pytest.param("sdpa", "cpu"), pytest.param("flex", "cpu")]
    cuda = KernelCapabilities.probe("cuda")
    for kernel in ("sdpa", "flex", "varlen", "flash_varlen"):
        reason = ("needs a CUDA GPU" if not torch.cuda.is_available()
                  else None if cuda.available(kernel) else f"needs {KERNEL_NEEDS[kernel]}")
        cases.append(pytest.param(kernel, "cuda", marks=[pytest.mark.skipif(reason is not None, reason=reason or "")]))
    return cases


@pytest.mark.parametrize("kernel, device", _kernel_cases())
def test_packed_equals_padded_forward_and_backward_on_every_kernel(tiny_model_dir, kernel, device, monkeypatch):
    """The loss and every gradient of a packed batch through each kernel equal the padded batch's, and
    that kernel is the one that ran. fp32 where the kernel takes it, bf16 autocast where it takes only half
    precision. FlexAttention refuses gradients on a CPU (it has no fused CPU backward); the test lifts that
    refusal to run flex's reference backward, which computes what the fused kernel computes from the same
    mask (the block structure the fused kernel reads is checked on its own, below)."""
    import torch
    from transformers import AutoModelForCausalLM

    from ftctl.models.packed_attention import HALF_PRECISION_ONLY
    from ftctl.training.packing_check import packed_training_gap

    if kernel == "flex" and device == "cpu":
        import torch.nn.attention.flex_attention as flex

        monkeypatch.setattr(flex, "_validate_device", lambda *tensors: None)
    half = kernel in HALF_PRECISION_ONLY
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa").to(device)
    gap = packed_training_gap(model, kernel, _examples(), 64, 0, torch.bfloat16 if half else torch.float32)
    assert gap["ran"] == {kernel}
    loss_tol, grad_tol = (2e-2, 5e-2) if half else (1e-5, 1e-4)
    assert gap["loss"] <= loss_tol and gap["grads"] <= grad_tol, gap


def test_the_kernel_check_sees_a_kernel_that_mixes_examples(tiny_model_dir, monkeypatch):
    """The check above can fail: per-example SDPA made to attend over the whole row is seen in the loss."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from ftctl.models import packed_attention
    from ftctl.training.packing_check import packed_training_gap

    def whole_rows(query, key, value, row_lengths, dropout, scaling):
        out = F.scaled_dot_product_attention(query, key, value, is_causal=True, scale=scaling,
                                             enable_gqa=query.shape[1] != key.shape[1])
        return out.transpose(1, 2).contiguous()

    monkeypatch.setattr(packed_attention, "_per_example_sdpa", whole_rows)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa")
    gap = packed_training_gap(model, "sdpa", _examples(), 64, 0)
    assert gap["loss"] > 1e-3 and gap["grads"] > 1e-2


def _packed_rows(rows, length, seed=0):
    """Cumulative lengths of ``rows`` packed rows of ``length`` positions: random examples filling each row."""
    import torch

    rng = np.random.default_rng(seed)
    spans = []
    for _ in range(rows):
        left = length
        while left:
            n = int(min(left, rng.integers(1, length // 3)))
            spans.append(n)
            left -= n
    return torch.tensor(np.concatenate([[0], np.cumsum(spans)]), dtype=torch.int32)


@pytest.mark.parametrize("rows, length, block", [(3, 300, 128), (2, 64, 16), (4, 100, 16)])
def test_flex_block_mask_is_the_document_mask_block_for_block(rows, length, block):
    """The block mask built from the boundaries equals the one FlexAttention builds by evaluating the
    document mask at every pair: partial and full blocks, key-side (forward) and query-side (backward)."""
    import torch
    from torch.nn.attention.flex_attention import create_block_mask

    from ftctl.models.packed_attention import document_block_mask

    cu = _packed_rows(rows, length)
    mine = document_block_mask(cu, rows, length, block)
    document = torch.searchsorted(cu[1:], torch.arange(rows * length, dtype=torch.int32), right=True).view(rows, length)
    dense = create_block_mask(lambda b, h, q, kv: (document[b, q] == document[b, kv]) & (q >= kv), rows, None, length,
                              length, device="cpu", BLOCK_SIZE=block)
    for counts, indices in (("kv_num_blocks", "kv_indices"), ("full_kv_num_blocks", "full_kv_indices"),
                            ("q_num_blocks", "q_indices"), ("full_q_num_blocks", "full_q_indices")):
        assert torch.equal(getattr(mine, counts), getattr(dense, counts)), counts
        n = getattr(dense, counts)
        for b in range(rows):
            for i, k in enumerate(n[b, 0].tolist()):
                assert torch.equal(getattr(mine, indices)[b, 0, i, :k], getattr(dense, indices)[b, 0, i, :k]), (indices, b, i)
    pairs = torch.arange(length)
    for b in range(rows):  # and the mask function itself, at every pair
        want = (document[b][:, None] == document[b][None, :]) & (pairs[:, None] >= pairs[None, :])
        got = mine.mask_mod(torch.tensor(b), torch.tensor(0), pairs[:, None], pairs[None, :])
        assert torch.equal(got, want)


def test_flex_block_mask_memory_is_linear_in_the_tokens():
    """8 rows × 4096: no tensor of the mask or of its construction grows with tokens²; a dense mask over
    the rows flattened would be 1 GiB of booleans, one per row 128 MiB."""
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from ftctl.models.packed_attention import document_block_mask

    rows, length = 8, 4096
    tokens = rows * length
    cu = _packed_rows(rows, length)
    largest = [0]

    class Allocations(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for t in (out if isinstance(out, (tuple, list)) else [out]):
                if isinstance(t, torch.Tensor):
                    largest[0] = max(largest[0], t.untyped_storage().nbytes())
            return out

    with Allocations():
        mask = document_block_mask(cu, rows, length)
    held = [getattr(mask, name) for name in ("kv_num_blocks", "kv_indices", "full_kv_num_blocks", "full_kv_indices",
                                             "q_num_blocks", "q_indices", "full_q_num_blocks", "full_q_indices")]
    held_bytes = sum(t.untyped_storage().nbytes() for t in held) + 4 * tokens  # and the example id of every token
    assert held_bytes <= 16 * tokens, held_bytes
    assert largest[0] <= 8 * tokens, largest[0]


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
    from ftctl.parallel.base import TorchEngine

    watch = HostReads()
    accumulating, step = TorchEngine.accumulating, TorchEngine.step

    def watched_accumulating(self, last_micro_batch):
        watch.start()
        return accumulating(self, last_micro_batch)

    def watched_step(self, max_grad_norm, sync):
        watch.stop()
        return step(self, max_grad_norm, sync)

    monkeypatch.setattr(TorchEngine, "accumulating", watched_accumulating)
    monkeypatch.setattr(TorchEngine, "step", watched_step)
    _count_python_reads(watch, monkeypatch)
    yield watch
    watch.stop()


def _count_python_reads(watch, monkeypatch):
    """Reads that bypass the dispatcher (tolist, numpy, cpu, item), made by the training loop's thread."""
    import threading

    import torch

    for method in ("tolist", "numpy", "cpu", "item"):
        real = getattr(torch.Tensor, method)

        def counted(self, *a, _real=real, _name=method, **k):
            if watch.active and threading.current_thread() is threading.main_thread():
                watch.seen.append(_name)
            return _real(self, *a, **k)

        monkeypatch.setattr(torch.Tensor, method, counted)


@pytest.mark.parametrize("objective", ["sft", "dpo"])
def test_micro_batch_loop_reads_nothing_back(make_cfg, run_training, micro_batch_loop_watch, on_cpu, objective):
    """The CPU proof of "no host sync in the micro-batch loop": no value of a tensor is read by the
    host between the first forward of a packed step and its optimizer step (two micro-batches per step).

    Padded batches are not held to it: transformers checks their padding mask on the device
    (``padding_mask.all()``) once per forward while building the attention mask."""
    _, metrics = run_training(make_cfg(*COMMON, *OBJECTIVES[objective], "data.packing=true"))
    assert [m["step"] for m in metrics if "loss" in m] == [1, 2]
    assert micro_batch_loop_watch.seen == []


@pytest.mark.parametrize("objective", sorted(OBJECTIVES))
def test_a_step_reduces_once_and_reads_once(make_cfg, run_training, monkeypatch, on_cpu, objective):
    """The loss, token counts, non-finite flags, the stop flag and the gradient norm travel in one tensor:
    one collective and one host read per step, from the first step's start to the loop's end (metrics
    lines every step and the stop check included). It was four of each: the global token count, the
    loss, the metrics' counts, the stop check (and the gradient norm's float and isfinite)."""
    import torch

    from ftctl.parallel.base import Backend
    from ftctl.training import runner
    from ftctl.training.metrics import MetricsLogger

    steps, collectives, watch = [], [], HostReads()
    reduce_sum, train_step, close = Backend.all_reduce_sum, runner.train_step, MetricsLogger.close

    def counted_reduce(self, value):
        collectives.append(len(steps))
        return reduce_sum(self, value)

    def counted_step(*args, **kwargs):
        steps.append(len(watch.seen))
        watch.start()
        return train_step(*args, **kwargs)

    def loop_ends(self):
        watch.stop()
        return close(self)

    def optimizer_step(self, *args, **kwargs):  # torch's AdamW reads its step counters, host tensors, per parameter
        watch.stop()
        try:
            return adamw_step(self, *args, **kwargs)
        finally:
            watch.start()

    def checkpoint(*args, **kwargs):  # every run saves its last step: host work after the loop's last read
        watch.stop()
        try:
            return save_checkpoint(*args, **kwargs)
        finally:
            watch.start()

    adamw_step, save_checkpoint = torch.optim.AdamW.step, runner.save_checkpoint
    monkeypatch.setattr(torch.optim.AdamW, "step", optimizer_step)
    monkeypatch.setattr(runner, "save_checkpoint", checkpoint)
    monkeypatch.setattr(Backend, "all_reduce_sum", counted_reduce)
    monkeypatch.setattr(runner, "train_step", counted_step)
    monkeypatch.setattr(MetricsLogger, "close", loop_ends)
    _count_python_reads(watch, monkeypatch)
    _, metrics = run_training(make_cfg(*COMMON, *OBJECTIVES[objective], "data.packing=true", "train.max_steps=3",
                                       "train.log_every=1", "train.save_every=0"))
    trained = [m for m in metrics if "loss" in m]
    assert [m["step"] for m in trained] == [1, 2, 3]
    if objective != "sft":  # the reward metrics came with the step's one reduction
        assert all("rewards/accuracies" in m and "logps/chosen" in m for m in trained)
    # KTO's KL estimate: one more collective before each step's micro-batches (the loss needs it), never read.
    assert collectives == ([1, 1, 2, 2, 3, 3] if objective == "kto" else [1, 2, 3])
    reads_before_each_step = steps + [len(watch.seen)]
    assert [b - a for a, b in zip(reads_before_each_step[1:], reads_before_each_step[2:])] == [1, 1], watch.seen
    assert len(watch.seen) == 3, watch.seen


def test_the_watch_sees_a_host_read(make_cfg, run_training, micro_batch_loop_watch, monkeypatch, on_cpu):
    """The watch above can fail: the loss read back per micro-batch, as the loop once did, is seen."""
    from ftctl.objectives import base as sft

    real = sft.token_loss_sum

    def reads_back(module, batch, device):
        loss = real(module, batch, device)
        loss.detach().double().cpu()
        float(loss)
        return loss

    monkeypatch.setattr(sft, "token_loss_sum", reads_back)
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

    device = "cuda" if torch.cuda.is_available() else "cpu"
    key = "mem_peak_alloc_gib" if device == "cuda" else "mem_peak_rss_gib"
    assert all(0.01 < m[key] < 1024 for m in lines)
    expected = "sdpa" if device == "cpu" else r"(flex|sdpa)"  # fp32: the varlen kernels take only half precision
    assert re.search(rf"packed attention: {expected} kernel on {device}", caplog.text), caplog.text


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
def test_regional_compile_trains_like_eager(make_cfg, run_training, monkeypatch, on_cpu):
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

    def relaxed_step(self, max_grad_norm, sync):
        torch.cuda.set_sync_debug_mode("default")
        return step(self, max_grad_norm, sync)

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


def test_qlora_keeps_no_more_for_backward_than_lora(make_cfg, on_cpu):
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


def test_full_bf16_keeps_a_compute_copy_of_every_linear_weight_and_the_estimate_counts_it(make_cfg, on_cpu):
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

    # The estimate adds exactly these copies. Everything else it counts grows with the micro-batch's tokens
    # (the output head's gradient is the same in bf16 and fp32), so the part that does not, 2·f(n) − f(2n),
    # differs between bf16 and fp32 by the copies alone: measured above, not taken from the estimator.
    def fixed_part(precision):
        def activations(micro_batch):
            return estimate_for(make_cfg("method=full", precision, f"train.micro_batch_size={micro_batch}",
                                         "train.global_batch_size=8")).activations_without_checkpointing_bytes
        return 2 * activations(1) - activations(2)

    assert abs((fixed_part("precision=bf16") - fixed_part("precision=fp32")) - sum(saved.values())) <= 2


def test_a_kernel_the_machine_lacks_is_refused_before_the_model_loads(make_cfg, run_training, monkeypatch):
    from ftctl.errors import ConfigError
    from ftctl.models.packed_attention import KernelCapabilities
    from ftctl.training import runner

    cpu_probe = KernelCapabilities.probe.__func__
    monkeypatch.setattr(KernelCapabilities, "probe", classmethod(lambda cls, device_type: cpu_probe(cls, "cpu")))
    monkeypatch.setattr(runner, "create_method", lambda *a: pytest.fail("the model was built"))
    with pytest.raises(ConfigError, match="data.packed_attention=flex needs CUDA"):
        run_training(make_cfg(*COMMON, "data.packing=true", "data.packed_attention=flex"))


@pytest.fixture
def flash_attn_on_a_fake_gpu(monkeypatch):
    """flash-attn installed and a CUDA device, as far as the attention choice can tell, on this CPU.

    The installed flash-attn is a module whose ``flash_attn_varlen_func`` computes causal attention
    per example from the boundaries on the CPU (and, like the real one, takes only fp16/bf16); the
    kernel probe answers for CUDA, where torch's varlen and flex kernels would run but cannot train
    on a CPU, so the fake GPU has flash-attn alone. transformers refuses its own ``flash_attention_2``
    on a CPU, so a model asked to load with it loads with a CPU stand-in that keeps transformers' packed
    path: masks from the restarting ``position_ids``. Yields the fake kernel's calls.
    """
    import dataclasses
    import importlib.machinery
    import sys
    import types

    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    from ftctl.models import packed_attention

    calls = []

    def flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p=0.0, softmax_scale=None, causal=False):
        assert q.dtype in (torch.float16, torch.bfloat16), "FlashAttention only supports fp16 and bf16 data type"
        calls.append(q.shape[0])
        positions = torch.arange(q.shape[0], dtype=cu_q.dtype)
        document = torch.searchsorted(cu_q[1:].contiguous(), positions, right=True)
        mask = (document[:, None] == document[None, :]) & (positions[:, None] >= positions[None, :])
        out = F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask,
                                             scale=softmax_scale, enable_gqa=q.shape[1] != k.shape[1])
        return out.transpose(0, 1)

    flash_attn = types.ModuleType("flash_attn")
    flash_attn.flash_attn_varlen_func = flash_attn_varlen_func
    flash_attn.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None)
    monkeypatch.setitem(sys.modules, "flash_attn", flash_attn)  # find_spec answers from sys.modules
    probe = packed_attention.KernelCapabilities.probe.__func__
    monkeypatch.setattr(packed_attention.KernelCapabilities, "probe", classmethod(
        lambda cls, device_type: dataclasses.replace(probe(cls, "cuda"), torch_varlen=False, flex=False)))

    from_pretrained = AutoModelForCausalLM.from_pretrained.__func__

    def loading_flash_on_cpu(cls, *args, attn_implementation=None, **kwargs):
        if attn_implementation != "flash_attention_2":
            return from_pretrained(cls, *args, attn_implementation=attn_implementation, **kwargs)
        model = from_pretrained(cls, *args, attn_implementation="sdpa", **kwargs)
        model.config._attn_implementation = "flash_attention_2"
        return model

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(loading_flash_on_cpu))
    monkeypatch.setitem(ALL_ATTENTION_FUNCTIONS._global_mapping, "flash_attention_2",
                        functools.partial(packed_attention.packed_attention_forward, kernel="sdpa"))
    return calls


def test_auto_with_flash_attn_on_cuda_goes_through_the_packed_seam(make_cfg, run_training, micro_batch_loop_watch,
                                                                   flash_attn_on_a_fake_gpu, caplog, on_cpu):
    """Issue 22's first defect, reproduced on the CPU: with flash-attn installed, ``auto`` loaded
    ``flash_attention_2``, so the packed kernel was never installed, transformers read ``position_ids``
    back on every forward to find the examples (seen by the watch), and no log line named a kernel.
    Now one decision loads sdpa and runs flash-attn's varlen kernel under it."""
    import logging

    with caplog.at_level(logging.INFO, logger="ftctl"):
        result, metrics = run_training(make_cfg(*COMMON, "data.packing=true", "precision=bf16"))
    assert [m["step"] for m in metrics if "loss" in m] == [1, 2]
    assert micro_batch_loop_watch.seen == []
    assert "packed attention: flash_varlen kernel on cuda\n" in caplog.text
    assert result.model.config._attn_implementation == "ftctl_packed_flash_varlen"
    assert len(flash_attn_on_a_fake_gpu) >= 2 * 2 * 2  # every layer of every micro-batch of both steps


def test_fp32_never_reaches_a_half_precision_kernel(make_cfg, run_training, flash_attn_on_a_fake_gpu, monkeypatch, caplog, on_cpu):
    """Issue 22's third defect: fp32 + packing on CUDA chose flash-attn's kernel, which takes only
    fp16/bf16, and failed inside the packing check. Asked for by name it is now refused in one line before
    the model loads; under auto the run takes a kernel that takes fp32 and the log says why."""
    import logging

    from ftctl.errors import ConfigError
    from ftctl.training import runner

    with monkeypatch.context() as patch:
        patch.setattr(runner, "create_method", lambda *a: pytest.fail("the model was built"))
        with pytest.raises(ConfigError, match=r"^data.packed_attention=flash_varlen takes only fp16/bf16 inputs and "
                                              r"precision is fp32; use precision=bf16, or data.packed_attention=auto "
                                              r"\(it picks sdpa here\)$"):
            run_training(make_cfg(*COMMON, "data.packing=true", "data.packed_attention=flash_varlen"))
    with caplog.at_level(logging.INFO, logger="ftctl"):
        run_training(make_cfg(*COMMON, "data.packing=true", "overwrite=true"))
    assert ("packed attention: sdpa kernel on cuda; flash_varlen passed over: it takes only fp16/bf16 inputs and "
            "precision is fp32\n") in caplog.text
    assert flash_attn_on_a_fake_gpu == []
