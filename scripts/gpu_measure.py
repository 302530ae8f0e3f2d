#!/usr/bin/env python
"""Issue 16's measurements on one GPU, in one prepared run (about 8 minutes on an H200).

    bash scripts/gpu_measure.sh          # on the GPU machine, from the project root; results in $OUT

Parts, most important first, each in its own process, each bounded so the whole run keeps to
GPU_MEASURE_BUDGET seconds (default 480); $OUT/gpu_measure.json is rewritten after every part:

1. the no-sync test (tests/test_gpu_path.py under torch.cuda.set_sync_debug_mode("error"));
2. Llama-3.2-1B shape, LoRA: ftctl packed and padded against TRL SFTTrainer padded and packed
   (and TRL+Liger and ftctl+Liger, train.kernels=liger, when liger-kernel is installed, which also runs
   tests/test_training_options.py's CUDA test of train.kernels=liger): trained tok/s, MFU, peak GPU memory;
3. the packed kernels one by one: varlen, flex, sdpa without cuDNN (flash_varlen if flash-attn is installed),
   each first checked (packed loss and gradients against padded, bf16, the tiny model) and then timed,
   recording the kernel that actually ran;
4. full fine-tuning and QLoRA, packed (QLoRA's peak memory against LoRA's at the same batch);
5. the estimate against torch.cuda.max_memory_allocated for full, LoRA and QLoRA on fixed-length
   batches (micro-batch 8 × 2048 tokens, every example longer than the row);
6. train.compile=true against eager, packed LoRA;
7. Llama-3.1-8B shape, LoRA packed (fits one H200? share of the bf16 peak).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OUT = Path(os.environ.get("OUT", "/tmp/out"))
WORK = Path(os.environ.get("GPU_MEASURE_WORK", "/tmp/ftctl-gpu-measure"))
BUDGET = float(os.environ.get("GPU_MEASURE_BUDGET", "480"))
T0 = time.time()
RESULTS: dict = {}
BENCH = [sys.executable, str(ROOT / "scripts" / "bench_throughput.py"), "--device", "cuda", "--work", str(WORK / "bench")]
SHORT = ["--steps", "6", "--warmup", "2"]


def left() -> float:
    return BUDGET - (time.time() - T0)


def save() -> None:
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "gpu_measure.json").write_text(json.dumps(RESULTS, indent=1, default=str))


def run(name: str, cmd: list, timeout: float, json_out: Path = None) -> dict:
    timeout = min(timeout, left() - 10)
    if timeout < 20:
        RESULTS[name] = {"skipped": "out of budget"}
        save()
        return RESULTS[name]
    env = dict(os.environ, PYTHONPATH=f"{ROOT}:{os.environ.get('PYTHONPATH', '')}", TOKENIZERS_PARALLELISM="false",
               FTCTL_HOME=str(WORK / "home"), HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1")
    start = time.time()
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=ROOT)
        rc, out, err = proc.returncode, proc.stdout, proc.stderr
    except subprocess.TimeoutExpired as exc:
        rc = "timeout"
        out = exc.stdout.decode(errors="replace") if isinstance(exc.stdout, bytes) else (exc.stdout or "")
        err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else (exc.stderr or "")
    result = {"rc": rc, "seconds": round(time.time() - start, 1), "stdout_tail": out[-3000:], "stderr_tail": err[-2000:]}
    if json_out is not None and json_out.exists():
        result["bench"] = json.loads(json_out.read_text())
    for line in out.splitlines():
        if line.startswith("MEMORY "):
            result.setdefault("memory", []).append(json.loads(line[len("MEMORY "):]))
        if line.startswith("KERNEL_CHECK "):
            result["check"] = json.loads(line[len("KERNEL_CHECK "):])
    RESULTS[name] = result
    save()
    print(f"[{time.time() - T0:6.1f}s] {name}: rc={rc} in {result['seconds']}s", flush=True)
    print("\n".join(line for line in out.splitlines() if line.startswith(("|", "ftctl", "trl", "MEMORY"))), flush=True)
    if rc != 0:
        print("   " + err[-800:].replace("\n", "\n   "), flush=True)
    return result


def bench(name: str, *args: str, timeout: float = 150) -> dict:
    path = WORK / f"{name}.json"
    path.unlink(missing_ok=True)
    return run(name, BENCH + list(args) + ["--json", str(path)], timeout, path)


# ------------------------------------------------------------------ estimate against the allocator


def long_records(path: Path, n: int) -> None:
    """Records longer than any row: every micro-batch is max_seq_len tokens wide, padded or not."""
    words = "alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega river mountain city".split()
    with open(path, "w") as f:
        for k in range(n):
            f.write(json.dumps({"instruction": " ".join(words[(k + j) % len(words)] for j in range(30)), "input": "",
                                "output": " ".join(words[(k * 3 + j) % len(words)] for j in range(3000))}) + "\n")


def memory_check(method: str, model_dir: str) -> None:
    """One method's peak allocated GPU memory over 3 steps of fixed 8 × 2048 batches, next to its estimate."""
    import torch

    from ftctl.config.compose import compose_config
    from ftctl.estimate import estimate_for
    from ftctl.training.run_dir import prepare_run_dir
    from ftctl.training.runner import train

    data = WORK / "long.jsonl"
    if not data.exists():
        long_records(data, 48)
    overrides = [f"model.name_or_path={model_dir}", f"method={method}", "precision=bf16", "data.format=alpaca",
                 f"data.path={data}", "data.max_seq_len=2048", "train.micro_batch_size=8", "train.global_batch_size=16",
                 "train.max_steps=3", "train.gradient_checkpointing=false", "train.progress_bar=false",
                 "train.tensorboard=false", f"output_dir={WORK / ('mem-' + method)}", "overwrite=true",
                 f"data.cache_dir={WORK / 'cache'}", "method.r=16", "method.alpha=32", "method.dropout=0.05",
                 "method.target_modules=[all-linear]"]
    cfg = compose_config(overrides)
    torch.cuda.reset_peak_memory_stats()
    train(cfg, prepare_run_dir(cfg))
    measured = torch.cuda.max_memory_allocated()
    est = estimate_for(cfg)
    print("MEMORY " + json.dumps({
        "method": method, "measured_gib": measured / 2**30, "reserved_gib": torch.cuda.max_memory_reserved() / 2**30,
        "estimate_gib": est.total_bytes / 2**30, "ratio": est.total_bytes / measured,
        "parts_gib": {k: v / 2**30 for k, v in est.to_dict().items() if k.endswith("_bytes")},
    }), flush=True)


# ------------------------------------------------------------------ packed kernels: right before fast


def kernel_check(kernel: str) -> None:
    """Packed against padded through ``kernel`` on the GPU: loss and every gradient, bf16 autocast, tiny model."""
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM

    from ftctl.models.tiny import build_tiny_llama
    from ftctl.training.packing_check import packed_training_gap

    model_dir = WORK / "tiny-llama"
    if not (model_dir / "config.json").exists():
        build_tiny_llama(model_dir)
    rng = np.random.default_rng(0)
    examples = []
    for n, prompt in ((30, 10), (17, 3), (45, 20), (9, 2), (22, 5), (60, 12)):
        ids = rng.integers(10, 500, n)
        labels = ids.copy()
        labels[:prompt] = -100
        examples.append((ids, labels))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="sdpa").cuda()
    gap = packed_training_gap(model, kernel, examples, 96, 0, torch.bfloat16)
    ok = gap["ran"] == {kernel} and gap["loss"] <= 2e-2 and gap["grads"] <= 5e-2
    print("KERNEL_CHECK " + json.dumps({**gap, "ran": sorted(gap["ran"]), "ok": ok}), flush=True)


def main() -> None:
    if len(sys.argv) > 2 and sys.argv[1] == "--memory":
        memory_check(sys.argv[2], sys.argv[3])
        return
    if len(sys.argv) > 2 and sys.argv[1] == "--kernel-check":
        kernel_check(sys.argv[2])
        return
    import importlib.util

    import torch

    WORK.mkdir(parents=True, exist_ok=True)
    RESULTS["env"] = {"torch": torch.__version__, "cuda": torch.version.cuda,
                      "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
                      **{m: importlib.util.find_spec(m) is not None for m in ("trl", "liger_kernel", "flash_attn", "bitsandbytes")}}
    save()
    print(json.dumps(RESULTS["env"]), flush=True)
    run("no_sync_test", [sys.executable, "-m", "pytest", "-q", "-x", str(ROOT / "tests" / "test_gpu_path.py"), "-k", "cuda"], 90)
    contenders = "ftctl-packed,ftctl-padded,trl,trl-packed" + (",trl-liger,ftctl-liger" if RESULTS["env"]["liger_kernel"] else "")
    if RESULTS["env"]["liger_kernel"]:
        run("liger_test", [sys.executable, "-m", "pytest", "-q", "-x", str(ROOT / "tests" / "test_training_options.py"), "-k", "liger"], 90)
    bench("lora_1b", "--contenders", contenders, "--steps", "8", "--warmup", "2", timeout=240)
    kernels = ["varlen", "flex", "sdpa"] + (["flash_varlen"] if RESULTS["env"]["flash_attn"] else [])
    for kernel in kernels:
        check = run(f"check_{kernel}", [sys.executable, __file__, "--kernel-check", kernel], 60).get("check", {})
        print(f"   packed = padded through {kernel}: {check}", flush=True)
        timed = bench(f"kernel_{kernel}", "--contenders", "ftctl-packed", "--override", f"data.packed_attention={kernel}",
                      *SHORT, timeout=90)
        runs = (timed.get("bench") or {}).get("runs", {}).get("ftctl-packed", [])
        timed["kernel_ran"] = [r.get("packed_kernel") for r in runs]
        save()
        print(f"   kernel that ran while timed: {timed['kernel_ran']}", flush=True)
    bench("full_1b", "--method", "full", "--contenders", "ftctl-packed", *SHORT, timeout=100)
    bench("qlora_1b", "--method", "qlora", "--contenders", "ftctl-packed,ftctl-padded", *SHORT, timeout=120)
    model_dir = WORK / "bench" / "llama-3.2-1b-random"
    for method in ("full", "lora", "qlora"):
        run(f"memory_{method}", [sys.executable, __file__, "--memory", method, str(model_dir)], 90)
    bench("compile_1b", "--contenders", "ftctl-packed", "--override", "train.compile=true", "--steps", "12", timeout=150)
    bench("lora_8b", "--model", "llama-3.1-8b", "--contenders", "ftctl-packed", "--steps", "3", "--warmup", "1",
          "--global-batch", "16", timeout=240)
    print(f"done in {time.time() - T0:.0f}s; results in {OUT / 'gpu_measure.json'}", flush=True)


if __name__ == "__main__":
    main()
