#!/usr/bin/env python
"""Throughput and peak memory of LoRA fine-tuning: ftctl against TRL's SFTTrainer, same everything.

    .venv/bin/python scripts/bench_throughput.py                      # SmolLM2-135M-Instruct, 2 rounds
    .venv/bin/python scripts/bench_throughput.py --steps 4 --rounds 1 # quicker
    .venv/bin/python scripts/bench_throughput.py --model tiny         # no SmolLM2: a local random Llama
    python scripts/bench_throughput.py --device cuda                  # GPU: Llama-3.2-1B shape, bf16, vs TRL
    python scripts/bench_throughput.py --device cuda --model llama-3.1-8b --contenders ftctl-packed

With ``--device cuda`` everything runs in bf16 on the GPU; ``--model`` may name a shape shipped in
recipes/model_configs (llama-3.2-1b, llama-3.1-8b), built with random weights and the tiny test
tokenizer (nothing is downloaded); contenders are ftctl packed and padded, TRL's SFTTrainer padded
and packed (padding-free), and TRL and ftctl (packed) with Liger kernels when liger-kernel is installed
(``trl-liger``, ``ftctl-liger``); ``--method`` full or qlora benchmarks those methods in ftctl. MFU is counted
against a bf16 matmul peak measured in each contender's own process, and the peak GPU memory
(``torch.cuda.max_memory_allocated``, and what the allocator reserved) is reported per contender.

Both trainers get the same model (fp32 on CPU, sdpa attention), the same tokenized examples (ftctl
tokenizes them; TRL receives its input_ids and labels as a pre-tokenized dataset, so both train the
same tokens), the same LoRA config, sequence length, batch, steps, optimizer, learning rate and
thread count. ftctl runs padded and packed. Every run is a fresh process, and runs are interleaved
(round 1: matmul peak, ftctl, TRL, ...; round 2 in reverse) with the best round of each reported, so
a noisy neighbour hurts every contender alike. Each run also reports how much CPU other processes
took during it ("others %": share of the machine's cores busy outside the run); numbers taken with
others above a few percent are noisy.

Reported per contender: trained tokens/s (tokens that carry loss), total tokens/s (every real token,
prompt included, padding excluded), the padding share of computed positions, peak RSS of the process,
and model FLOP/s: the FLOPs the training step needs (forward + backward of the transformer on real
tokens, the output head on trained tokens, attention causal and per example; no recomputation,
padding or waste counted), divided by the time taken, against the fp32 matmul peak measured in the
same run: the best of the separate peak runs, and the mean of two short measurements taken in the
contender's own process just before and just after it trains (the machine's speed drifts, and this
is the peak under the run's own conditions).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import random
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

WORDS = (
    "the model learns to answer questions about data files training steps memory kernels threads tokens batches "
    "a small language model can follow simple instructions when it is fine tuned on a few thousand examples "
    "write explain summarise list compare translate classify extract describe why how when which what where "
    "river mountain city garden market library engine bridge window planet ocean forest winter summer morning "
    "quickly carefully slowly clearly briefly exactly usually often never always sometimes rarely together apart "
    "number letter colour animal country language recipe story poem email report table chart graph function"
).split()


# ----------------------------------------------------------------------------------------------- data


#: Word counts (mean, sigma, cap) of instruction, input and output. "gpu": longer answers (≈ 450 tokens
#: per example with the tiny tokenizer, like the GPU check kit's data), for batches of 8 × 2048 tokens.
DATA_PROFILES = {
    "cpu": ((12, 0.4, 40), (25, 0.8, 120), (70, 0.8, 300)),
    "gpu": ((20, 0.4, 60), (60, 0.8, 400), (220, 0.8, 900)),
}


def write_dataset(path: Path, n: int, seed: int, profile: str = "cpu") -> None:
    """Alpaca records whose lengths vary like real instruction data (log-normal answers, optional inputs)."""
    rng = random.Random(seed)
    instruction, inputs, output = DATA_PROFILES[profile]

    def text(mean_words: float, sigma: float = 0.7, cap: int = 300) -> str:
        k = max(1, min(cap, int(rng.lognormvariate(0, sigma) * mean_words)))
        return " ".join(rng.choice(WORDS) for _ in range(k))

    with open(path, "w") as f:
        for _ in range(n):
            record = {
                "instruction": text(*instruction),
                "input": text(*inputs) if rng.random() < 0.4 else "",
                "output": text(*output),
            }
            f.write(json.dumps(record) + "\n")


# -------------------------------------------------------------------------------------------- workers


def cpu_jiffies() -> tuple:
    """(busy jiffies of the whole machine, jiffies of this process and its children)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    busy = sum(fields) - fields[3] - fields[4]  # minus idle and iowait
    t = os.times()
    ticks = os.sysconf("SC_CLK_TCK")
    return busy, int((t.user + t.system + t.children_user + t.children_system) * ticks)


class Interference:
    """Share of the machine's CPU used by other processes between start() and stop()."""

    def start(self):
        self.t0, (self.busy0, self.own0) = time.perf_counter(), cpu_jiffies()

    def stop(self) -> float:
        elapsed = time.perf_counter() - self.t0
        busy, own = cpu_jiffies()
        ticks = os.sysconf("SC_CLK_TCK")
        others = max(0, (busy - self.busy0) - (own - self.own0)) / ticks
        return others / (elapsed * os.cpu_count())


def peak_rss_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def matmul_peak(seconds_per_shape: float, precision: str = "fp32") -> float:
    """Best FLOP/s of torch.mm (fp32, or bf16 on CPUs that compute it) over a square shape and the two MLP
    shapes of a 576-wide model."""
    import torch

    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16}[precision]
    torch.manual_seed(0)
    best = 0.0
    for m, k, n in ((2048, 2048, 2048), (4096, 576, 1536), (4096, 1536, 576)):
        a, b = torch.randn(m, k, dtype=dtype), torch.randn(k, n, dtype=dtype)
        out = torch.empty(m, n, dtype=dtype)
        for _ in range(3):
            torch.mm(a, b, out=out)
        reps, start = 0, time.perf_counter()
        while time.perf_counter() - start < seconds_per_shape:
            torch.mm(a, b, out=out)
            reps += 1
        best = max(best, 2 * m * k * n * reps / (time.perf_counter() - start))
    return best


def gpu_bf16_peak(seconds: float = 0.5) -> float:
    """Best bf16 FLOP/s of an 8192³ matmul on the GPU (the same measurement as the GPU check kit's)."""
    import torch

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    b = torch.randn_like(a)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    reps, start = 0, time.perf_counter()
    while time.perf_counter() - start < seconds:
        for _ in range(5):
            a @ b
        torch.cuda.synchronize()
        reps += 5
    peak = 2 * 8192**3 * reps / (time.perf_counter() - start)
    del a, b
    torch.cuda.empty_cache()
    return peak


def on_gpu(settings: dict) -> bool:
    return settings.get("device", "cpu") == "cuda"


def worker_matmul(settings: dict) -> dict:
    import torch

    if on_gpu(settings):
        return {"matmul_flops": gpu_bf16_peak(2.0), "threads": torch.get_num_threads(), "dtype": "bf16"}
    precision = settings.get("precision", "fp32")
    return {"matmul_flops": matmul_peak(2.0, precision), "threads": torch.get_num_threads(), "dtype": precision}


def bracketed_by_peaks(train, settings: dict = None):
    """Run ``train()`` between two short matmul-peak measurements in the same process.

    The machine's speed drifts by tens of percent over minutes (shared host), so the peak that
    applies to a run is the one measured around it; their mean goes with the run's result. On a
    GPU the peak is bf16 and the run also reports its peak GPU memory.
    """
    gpu = on_gpu(settings or {})
    cpu_precision = (settings or {}).get("precision", "fp32")
    measure = gpu_bf16_peak if gpu else (lambda seconds: matmul_peak(seconds, cpu_precision))
    before = measure(1.0 if not gpu else 0.5)
    if gpu:
        import torch

        torch.cuda.reset_peak_memory_stats()
    result = train()
    if gpu:
        result["peak_mem_alloc_gib"] = torch.cuda.max_memory_allocated() / 2**30
        result["peak_mem_reserved_gib"] = torch.cuda.max_memory_reserved() / 2**30
    result["run_peak_flops"] = (before + measure(1.0 if not gpu else 0.5)) / 2
    return result


def model_flops(config: dict, lengths, trained: int, lora_r: int, full: bool = False) -> float:
    """FLOPs one training step needs: transformer forward + backward on ``lengths``, head on ``trained`` tokens.

    Linear layers cost 2·params per token forward and as much again for the input gradient (and, for
    full fine-tuning, for the weight gradient); LoRA adds its two low-rank matmuls and their weight
    gradients. The first layer's input gradient is not needed when nothing below it trains. Causal
    attention costs 2·2·heads·head_dim·len·(len+1)/2 per example forward and twice that backward.
    """
    from ftctl.models.architecture import Architecture

    arch = Architecture.from_config(config)
    shapes = {name: (i, o) for name, (i, o, _) in arch.linear_shapes().items()}
    tokens = sum(lengths)
    per_layer = sum(i * o for i, o in shapes.values())
    first_inputs = sum(i * o for name, (i, o) in shapes.items() if name in ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"))
    forward = 2 * per_layer * arch.layers * tokens
    input_grads = 2 * per_layer * arch.layers * tokens - (0 if full else 2 * first_inputs * tokens)
    weight_grads = 2 * per_layer * arch.layers * tokens if full else 0
    lora = 0 if full else 3 * 2 * lora_r * sum(i + o for i, o in shapes.values()) * arch.layers * tokens
    attention = 3 * sum(2 * arch.attention_width * n * (n + 1) for n in lengths) * arch.layers
    head = (3 if full else 2) * 2 * arch.hidden * arch.vocab * trained
    return float(forward + input_grads + weight_grads + lora + attention + head)


def _common_overrides(s: dict) -> list:
    return [
        f"model.name_or_path={s['model_dir']}",
        f"method={s.get('method', 'lora')}", f"method.r={s['lora_r']}", f"method.alpha={s['lora_alpha']}",
        f"method.dropout={s['lora_dropout']}",
        f"precision={s.get('precision', 'fp32')}", "data.format=alpaca", f"data.path={s['data']}", f"data.max_seq_len={s['seq_len']}",
        f"data.cache_dir={s['cache_dir']}",
        f"train.micro_batch_size={s['micro']}", f"train.global_batch_size={s['global']}",
        f"train.max_steps={s['warmup'] + s['steps']}", f"train.lr={s['lr']}", "train.warmup_steps=0",
        "train.max_grad_norm=1.0", "train.weight_decay=0.0", f"seed={s['seed']}",
    ]


def tokenized(s: dict):
    """ftctl's tokenization of the benchmark file, shared by both trainers."""
    from ftctl.config.compose import compose_config
    from ftctl.data.dataset import build_datasets
    from ftctl.models.loading import load_tokenizer

    cfg = compose_config(_common_overrides(s) + ["output_dir=/tmp/unused"])
    tokenizer = load_tokenizer(cfg.model, s["model_dir"])
    data, _ = build_datasets(cfg.data, tokenizer, cfg.seed)
    return cfg, tokenizer, data


def worker_ftctl(s: dict) -> dict:
    from ftctl.config.compose import compose_config
    from ftctl.data.batching import StepSampler
    from ftctl.models.packed_attention import record_packed_kernels
    from ftctl.training.metrics import read_metrics
    from ftctl.training.run_dir import prepare_run_dir
    from ftctl.training.runner import train

    _, _, data = tokenized(s)
    run_dir = Path(s["work"]) / f"ftctl-{'packed' if s['packing'] else 'padded'}-{s.get('kernels', 'ftctl')}-{os.getpid()}"
    cfg = compose_config(_common_overrides(s) + [
        f"output_dir={run_dir}", f"data.packing={str(s['packing']).lower()}", "train.log_every=1",
        "train.progress_bar=false", "train.tensorboard=false", f"train.kernels={s.get('kernels', 'ftctl')}",
        *s.get("extra_overrides", []),
    ])
    with record_packed_kernels() as ran:  # what ran, not what was asked for (compiled layers are not seen)
        train(cfg, prepare_run_dir(cfg))
    steps = [m for m in read_metrics(run_dir) if "loss" in m][s["warmup"]:]
    seconds = sum(m["trained_tokens"] / m["trained_tokens_per_s"] for m in steps)
    sampler = StepSampler(len(data), s["global"], cfg.seed, cfg.data.shuffle)
    lengths = [int(data.offsets[i + 1] - data.offsets[i]) for step in range(s["warmup"], s["warmup"] + s["steps"])
               for i in sampler.global_batch(step)]
    trained = sum(m["trained_tokens"] for m in steps)
    config = json.loads((Path(s["model_dir"]) / "config.json").read_text())
    return {
        "seconds": seconds, "trained_tokens": trained, "real_tokens": sum(lengths),
        "padding_waste": sum(m["padding_waste"] for m in steps) / len(steps),
        "flops": model_flops(config, lengths, trained, s["lora_r"], full=s.get("method") == "full"),
        "final_loss": steps[-1]["loss"],
        **({"packed_kernel": "+".join(sorted(ran)) or "none"} if s["packing"] else {}),
    }


def worker_trl(s: dict) -> dict:
    """TRL's SFTTrainer on the same tokenized examples: padded, or packed (padding-free) with ``packing``,
    with Liger's kernels with ``liger``; bf16 on a GPU, the bench's precision on the CPU."""
    import torch
    from datasets import Dataset
    from peft import LoraConfig
    from transformers import AutoModelForCausalLM, TrainerCallback
    from trl import SFTConfig, SFTTrainer

    gpu = on_gpu(s)
    _, tokenizer, data = tokenized(s)
    rows = {"input_ids": [], "labels": []}
    for i in range(len(data)):
        ids, labels = data[i]
        rows["input_ids"].append(ids.tolist())
        rows["labels"].append(labels.tolist())
    dataset = Dataset.from_dict(rows)
    dtype = torch.bfloat16 if gpu else torch.float32
    model = AutoModelForCausalLM.from_pretrained(s["model_dir"], dtype=dtype, attn_implementation="sdpa")
    counts, step_ends = [], []

    class Timer(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            if gpu:
                torch.cuda.synchronize()
            step_ends.append(time.perf_counter())

    class CountingSFTTrainer(SFTTrainer):
        def training_step(self, model, inputs, num_items_in_batch=None):
            ids, mask = inputs["input_ids"], inputs.get("attention_mask")
            trained = int((inputs["labels"][:, 1:] != -100).sum())
            if mask is not None:
                counts.append((int(mask.sum()), trained, int(mask.numel()), mask.sum(dim=1).tolist()))
            else:  # padding-free: one row, examples marked by position_ids restarting at 0
                pos = inputs["position_ids"].flatten().tolist()
                starts = [i for i, p in enumerate(pos) if p == 0] + [len(pos)]
                counts.append((ids.numel(), trained, ids.numel(), [b - a for a, b in zip(starts, starts[1:])]))
            return super().training_step(model, inputs, num_items_in_batch)

    accumulation = s["global"] // s["micro"]
    args = SFTConfig(
        output_dir=str(Path(s["work"]) / f"trl-{os.getpid()}"), per_device_train_batch_size=s["micro"],
        gradient_accumulation_steps=accumulation, max_steps=s["warmup"] + s["steps"], learning_rate=s["lr"],
        lr_scheduler_type="cosine", warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, optim="adamw_torch",
        max_length=s["seq_len"], packing=bool(s.get("packing")), gradient_checkpointing=False, bf16=gpu or s.get("precision") == "bf16", fp16=False,
        use_cpu=not gpu, report_to="none", save_strategy="no", logging_steps=10**6, disable_tqdm=True,
        dataloader_num_workers=0, seed=s["seed"], data_seed=s["seed"],
        **({"use_liger_kernel": True} if s.get("liger") else {}),
    )
    lora = LoraConfig(r=s["lora_r"], lora_alpha=s["lora_alpha"], lora_dropout=s["lora_dropout"],
                      target_modules="all-linear", bias="none", task_type="CAUSAL_LM")
    trainer = CountingSFTTrainer(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                                 peft_config=lora, callbacks=[Timer()])
    trainer.train()
    measured = counts[s["warmup"] * accumulation:]
    lengths = [n for c in measured for n in c[3]]
    trained = sum(c[1] for c in measured)
    config = json.loads((Path(s["model_dir"]) / "config.json").read_text())
    return {
        "seconds": step_ends[-1] - step_ends[s["warmup"] - 1], "trained_tokens": trained, "real_tokens": sum(c[0] for c in measured),
        "padding_waste": 1 - sum(c[0] for c in measured) / sum(c[2] for c in measured),
        "flops": model_flops(config, lengths, trained, s["lora_r"]),
    }


WORKERS = {"matmul": worker_matmul, "ftctl": worker_ftctl, "trl": worker_trl}
#: Contender name -> (worker, its settings on top of the common ones).
CONTENDERS = {
    "ftctl-packed": ("ftctl", {"packing": True}),
    "ftctl-padded": ("ftctl", {"packing": False}),
    # ftctl packed with train.kernels=liger: liger-kernel's RMSNorm, SwiGLU, RoPE and fused linear cross-entropy.
    "ftctl-liger": ("ftctl", {"packing": True, "kernels": "liger"}),
    "trl": ("trl", {"packing": False}),
    "trl-packed": ("trl", {"packing": True}),
    "trl-liger": ("trl", {"packing": False, "liger": True}),
}


def run_worker(kind: str, settings: dict) -> dict:
    monitor = Interference()
    monitor.start()
    work = functools.partial(WORKERS[kind], settings)
    result = work() if kind == "matmul" else bracketed_by_peaks(work, settings)
    result["others"] = monitor.stop()
    result["peak_rss_mib"] = peak_rss_mib()
    return result


# --------------------------------------------------------------------------------------------- parent


def build_shape_model(config_path: Path, out: Path, device: str) -> str:
    """A random-weight bf16 model of the architecture in ``config_path``, with the tiny test tokenizer."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from ftctl.models.tiny import build_tokenizer

    if (out / "config.json").exists():
        return str(out)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(out)
    config = {k: v for k, v in json.loads(config_path.read_text()).items() if not k.startswith("_")}
    config.update(eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id, bos_token_id=None)
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(config.pop("model_type"), **config), dtype=torch.bfloat16)
    model.save_pretrained(out, safe_serialization=True)
    return str(out)


def resolve_model(name: str, work: Path, device: str = "cpu") -> str:
    from ftctl.models.aliases import is_alias
    from ftctl.paths import model_configs_dir

    shape = model_configs_dir() / f"{name}.json"
    if not is_alias(name) and shape.is_file():
        return build_shape_model(shape, work / f"{name}-random", device)
    if name == "tiny":
        from ftctl.models.tiny import build_tiny_llama

        out = work / "tiny-bench-llama"
        if not (out / "config.json").exists():
            build_tiny_llama(out, num_layers=8, hidden_size=512, num_heads=8, num_kv_heads=4, intermediate_size=1536,
                             vocab_size=4096, max_position_embeddings=2048)
        return str(out)
    from ftctl.errors import FtctlError
    from ftctl.models.loading import resolve_model_path

    try:
        return resolve_model_path(name)
    except FtctlError as exc:
        print(f"model {name} is not available ({exc}); using a local random Llama instead", flush=True)
        return resolve_model("tiny", work)


def spawn(kind: str, settings: dict, label: str) -> dict:
    env = dict(os.environ, TOKENIZERS_PARALLELISM="false", PYTHONWARNINGS="ignore")
    cmd = [sys.executable, __file__, "--worker", kind, "--settings", json.dumps(settings)]
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
    line = next((ln for ln in reversed(proc.stdout.splitlines()) if ln.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        sys.stderr.write(proc.stdout[-3000:] + proc.stderr[-6000:])
        if kind == "matmul" or not settings.get("keep_going"):
            raise SystemExit(f"{label} failed (exit {proc.returncode})")
        print(f"  {label:<14} FAILED (exit {proc.returncode}); left out of the table", flush=True)
        return {"failed": proc.returncode, "stderr_tail": proc.stderr[-2000:]}
    result = json.loads(line[len("RESULT "):])
    print(f"  {label:<14} {_describe(result)}", flush=True)
    return result


def _describe(r: dict) -> str:
    if "matmul_flops" in r:
        return (f"{r.get('dtype', 'fp32')} matmul peak {r['matmul_flops'] / 1e9:.1f} GFLOP/s ({r['threads']} threads), "
                f"others {r['others']:.0%}")
    gpu = f", peak GPU memory {r['peak_mem_alloc_gib']:.1f} GiB" if "peak_mem_alloc_gib" in r else ""
    return (f"{r['trained_tokens'] / r['seconds']:.0f} trained tok/s, {r['real_tokens'] / r['seconds']:.0f} tok/s, "
            f"{r['flops'] / r['seconds'] / 1e9:.1f} GFLOP/s (in-process peak {r['run_peak_flops'] / 1e9:.1f}), "
            f"peak RSS {r['peak_rss_mib']:.0f} MiB{gpu}, others {r['others']:.0%}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--worker", choices=sorted(WORKERS), help=argparse.SUPPRESS)
    p.add_argument("--settings", help=argparse.SUPPRESS)
    p.add_argument("--device", choices=("cpu", "cuda"), default="cpu", help="cuda: bf16 on the GPU, with GPU defaults below")
    p.add_argument("--model", help="alias, dir, a shape in recipes/model_configs (llama-3.2-1b, llama-3.1-8b), or 'tiny' "
                                   "(default: smollm2-135m-instruct on cpu, llama-3.2-1b on cuda)")
    p.add_argument("--precision", choices=("fp32", "bf16"), help="compute precision on the CPU (default fp32; bf16 "
                   "for CPUs with avx512_bf16/AMX); always bf16 on cuda")
    p.add_argument("--method", choices=("lora", "full", "qlora"), default="lora", help="ftctl's method (TRL runs LoRA)")
    p.add_argument("--steps", type=int, help="measured optimizer steps per run (default 6 cpu, 12 cuda)")
    p.add_argument("--warmup", type=int, help="unmeasured steps first (default 1 cpu, 3 cuda)")
    p.add_argument("--micro", type=int, help="default 4 cpu, 8 cuda")
    p.add_argument("--global-batch", type=int, help="default 8 cpu, 32 cuda")
    p.add_argument("--seq-len", type=int, help="default 512 cpu, 2048 cuda")
    p.add_argument("--examples", type=int, help="records in the benchmark file (default: enough for every step; 600 on cuda)")
    p.add_argument("--lora-r", type=int, default=16)
    p.add_argument("--lora-dropout", type=float, default=0.05)
    p.add_argument("--rounds", type=int, help="interleaved repetitions; the best of each is reported (default 2 cpu, 1 cuda)")
    p.add_argument("--contenders", help="comma-separated, from: " + ", ".join(CONTENDERS) +
                   " (default ftctl-packed,ftctl-padded,trl; on cuda also trl-packed, and trl-liger and ftctl-liger when liger-kernel is installed)")
    p.add_argument("--override", action="append", default=[], help="extra ftctl override for ftctl runs (repeatable), "
                                                                   "e.g. data.packed_attention=flex or train.compile=true")
    p.add_argument("--work", help="work dir to keep and reuse (built models, tokenized data); default a fresh temp dir")
    p.add_argument("--json", help="also write the results here")
    args = p.parse_args()
    if args.worker:
        result = run_worker(args.worker, json.loads(args.settings))
        print("RESULT " + json.dumps(result), flush=True)
        return

    gpu = args.device == "cuda"
    defaults = {"model": "llama-3.2-1b", "steps": 12, "warmup": 3, "micro": 8, "global_batch": 32, "seq_len": 2048,
                "rounds": 1} if gpu else \
               {"model": "smollm2-135m-instruct", "steps": 6, "warmup": 1, "micro": 4, "global_batch": 8, "seq_len": 512,
                "rounds": 2}
    for key, value in defaults.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    if args.contenders is None:
        import importlib.util

        args.contenders = "ftctl-packed,ftctl-padded,trl" + (",trl-packed" if gpu else "") + \
            (",trl-liger,ftctl-liger" if gpu and importlib.util.find_spec("liger_kernel") else "")

    work = Path(args.work) if args.work else Path(tempfile.mkdtemp(prefix="ftctl-bench-"))
    work.mkdir(parents=True, exist_ok=True)
    os.environ.setdefault("FTCTL_HOME", str(work / "home"))
    steps_total = args.warmup + args.steps
    data = work / "bench_alpaca.jsonl"
    write_dataset(data, args.examples or (600 if gpu else steps_total * args.global_batch), seed=0,
                  profile="gpu" if gpu else "cpu")
    precision = "bf16" if gpu else (args.precision or "fp32")
    settings = {
        "model_dir": resolve_model(args.model, work, args.device), "data": str(data), "cache_dir": str(work / "cache"),
        "work": str(work), "seq_len": args.seq_len, "micro": args.micro, "global": args.global_batch,
        "steps": args.steps, "warmup": args.warmup, "lr": 2e-5 if args.method == "full" else 2e-4, "seed": 0,
        "lora_r": args.lora_r, "lora_alpha": 2 * args.lora_r, "lora_dropout": args.lora_dropout,
        "device": args.device, "precision": precision, "method": args.method, "extra_overrides": args.override,
        "keep_going": gpu,  # one contender failing on a GPU (an optional kernel, say) must not void the others
    }
    chosen = [c.strip() for c in args.contenders.split(",")]
    unknown = [c for c in chosen if c not in CONTENDERS]
    if unknown:
        raise SystemExit(f"unknown contenders {unknown}; choose from {', '.join(CONTENDERS)}")
    print(f"model {settings['model_dir']}; {args.steps} measured steps (+{args.warmup} warmup) of {args.global_batch} "
          f"examples (micro {args.micro}), max_seq_len {args.seq_len}, ftctl method {args.method}, LoRA r{args.lora_r} "
          f"alpha {2 * args.lora_r} dropout {args.lora_dropout:g} all-linear, {precision} on {args.device}, {os.cpu_count()} CPUs")
    contenders = CONTENDERS
    results = {name: [] for name in ["matmul"] + chosen}
    for round_no in range(args.rounds):
        print(f"round {round_no + 1}", flush=True)
        order = ["matmul"] + (chosen if round_no % 2 == 0 else chosen[::-1])
        for name in order:
            kind, extra = ("matmul", {}) if name == "matmul" else contenders[name]
            results[name].append(spawn(kind, {**settings, **extra}, name))
            if args.json:  # what has run so far survives a run stopped half-way
                Path(args.json).write_text(json.dumps({"partial": True, "runs": results}, indent=2))
    report(results, chosen, args)


def report(results: dict, chosen: list, args) -> None:
    peak = max(r["matmul_flops"] for r in results["matmul"])
    for name in chosen:
        results[name] = [r for r in results[name] if "failed" not in r]
    chosen = [name for name in chosen if results[name]]
    best = {name: min(results[name], key=lambda r: r["seconds"] / r["trained_tokens"]) for name in chosen}
    dtype = results["matmul"][0].get("dtype", "fp32")
    print(f"\nbest of {args.rounds} round(s); {dtype} matmul peak {peak / 1e9:.1f} GFLOP/s\n")
    if args.device == "cuda":
        report_gpu(best, chosen, peak)
        if args.json:
            Path(args.json).write_text(json.dumps({"matmul_peak_flops": peak, "runs": results}, indent=2))
        return
    header = ("| contender | trained tok/s | total tok/s | padding | peak RSS MiB | model GFLOP/s | % of matmul peak "
              "| in-process peak GFLOP/s | % of it | others |")
    print(header)
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for name in chosen:
        r = best[name]
        flops = r["flops"] / r["seconds"]
        print(f"| {name} | {r['trained_tokens'] / r['seconds']:.0f} | {r['real_tokens'] / r['seconds']:.0f} | "
              f"{r['padding_waste']:.0%} | {r['peak_rss_mib']:.0f} | {flops / 1e9:.1f} | {flops / peak:.0%} | "
              f"{r['run_peak_flops'] / 1e9:.1f} | {flops / r['run_peak_flops']:.0%} | {r['others']:.0%} |")
    if "trl" in best:
        for name in chosen:
            if name.startswith("ftctl"):
                ratio = (best[name]["trained_tokens"] / best[name]["seconds"]) / (best["trl"]["trained_tokens"] / best["trl"]["seconds"])
                rss = best[name]["peak_rss_mib"] / best["trl"]["peak_rss_mib"]
                print(f"{name}: {ratio:.2f}x TRL's trained tokens/s at {rss:.2f}x its peak RSS")
    if args.json:
        Path(args.json).write_text(json.dumps({"matmul_peak_flops": peak, "runs": results}, indent=2))


def report_gpu(best: dict, chosen: list, peak: float) -> None:
    """The GPU table: trained tok/s, MFU against the in-process bf16 peak, peak GPU memory; ratios to TRL padded."""
    print("| contender | trained tok/s | total tok/s | padding | model TFLOP/s | MFU (in-process bf16 peak) "
          "| peak GPU memory GiB (allocated / reserved) | packed kernel |")
    print("|---|---:|---:|---:|---:|---:|---:|---|")
    for name in chosen:
        r = best[name]
        flops = r["flops"] / r["seconds"]
        print(f"| {name} | {r['trained_tokens'] / r['seconds']:.0f} | {r['real_tokens'] / r['seconds']:.0f} | "
              f"{r['padding_waste']:.0%} | {flops / 1e12:.1f} | {flops / r['run_peak_flops']:.1%} | "
              f"{r['peak_mem_alloc_gib']:.1f} / {r['peak_mem_reserved_gib']:.1f} | {r.get('packed_kernel', '-')} |")
    if "trl" in best:
        base = best["trl"]
        for name in chosen:
            if name != "trl":
                r = best[name]
                ratio = (r["trained_tokens"] / r["seconds"]) / (base["trained_tokens"] / base["seconds"])
                print(f"{name}: {ratio:.2f}x TRL padded's trained tokens/s at "
                      f"{r['peak_mem_alloc_gib'] / base['peak_mem_alloc_gib']:.2f}x its peak GPU memory")


if __name__ == "__main__":
    main()
