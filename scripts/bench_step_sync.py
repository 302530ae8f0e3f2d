#!/usr/bin/env python
"""What one training step costs in collectives, host reads and time: 2 DDP ranks (gloo) on the CPU, tiny model.

    python scripts/bench_step_sync.py [--steps 60] [--warmup 10] [--nproc 2]

Launches ``torch.distributed.run`` with this file as the worker. Each rank trains the tiny 2-layer
Llama through the real runner and times every call of ``runner.train_step`` (forward, backward,
optimizer step and whatever the step reduces), counting the ``torch.distributed`` collectives and the
host reads of tensor values that ftctl's own code makes in the training loop's thread (``item``,
``tolist``, ``__float__``, ``__bool__``, ``__int__``, ``cpu``; not torch's own, such as the optimizer's
CPU step counter, nor the collator's host tensors on the batch-building thread)
from one step's start to the next's (the loop's metrics and stop check included; the median over
steps, so the log steps' extra reads do not count); rank 0 prints one JSON line.
The counts are exact; the times depend on the machine's load.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def worker(work: Path, steps: int, warmup: int) -> None:
    import torch
    import torch.distributed as dist

    from ftctl.config.compose import compose_config
    from ftctl.training import runner
    from ftctl.worker import train_under_launcher

    counts = {"collectives": 0, "host_reads": 0}
    watching = [False]

    def counting(fn, key, own_only=False):
        def wrapped(*args, **kwargs):
            if watching[0] and (not own_only or (f"{os.sep}ftctl{os.sep}" in sys._getframe(1).f_code.co_filename
                                                 and threading.current_thread() is threading.main_thread())):
                counts[key] += 1
            return fn(*args, **kwargs)
        return wrapped

    for name in ("all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "barrier"):
        setattr(dist, name, counting(getattr(dist, name), "collectives"))
    for name in ("item", "tolist", "__float__", "__bool__", "__int__", "cpu"):
        setattr(torch.Tensor, name, counting(getattr(torch.Tensor, name), "host_reads", own_only=True))

    starts, at_start = [], []  # a step runs from one train_step call to the next: the loop's own reads count too
    real_step = runner.train_step

    def timed_step(*args, **kwargs):
        watching[0] = True
        starts.append(time.perf_counter())
        at_start.append(dict(counts))
        return real_step(*args, **kwargs)

    runner.train_step = timed_step
    cfg = compose_config([
        "recipe=tiny_lora", f"model.name_or_path={work / 'model'}", f"output_dir={work / 'run'}", "overwrite=true",
        "parallel=ddp", f"parallel.nproc_per_node={os.environ.get('WORLD_SIZE', '1')}", "precision=fp32",
        f"train.max_steps={steps}", "train.micro_batch_size=2", "train.global_batch_size=8", "train.log_every=10",
        "train.progress_bar=false", "train.tensorboard=false", "train.plot=false", "train.num_threads=1",
        "train.save_every=0", "data.max_seq_len=64", "method.dropout=0.0",
    ])
    train_under_launcher(cfg)
    if int(os.environ.get("RANK", "0")) == 0:
        times = [b - a for a, b in zip(starts, starts[1:])][warmup:]
        deltas = [{k: b[k] - a[k] for k in counts} for a, b in zip(at_start, at_start[1:])][warmup:]
        print(json.dumps({
            "steps_timed": len(times), "step_ms_median": round(1000 * statistics.median(times), 2),
            "step_ms_mean": round(1000 * statistics.fmean(times), 2),
            "collectives_per_step": statistics.median(d["collectives"] for d in deltas),
            "host_reads_per_step": statistics.median(d["host_reads"] for d in deltas),
        }))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--nproc", type=int, default=2)
    parser.add_argument("--worker", metavar="DIR", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(Path(args.worker), args.steps, args.warmup)
        return
    from ftctl.models.tiny import build_tiny_llama

    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        build_tiny_llama(work / "model")
        env = dict(os.environ, OMP_NUM_THREADS="1", TOKENIZERS_PARALLELISM="false", CUDA_VISIBLE_DEVICES="",
                   FTCTL_HOME=str(work / "home"), PYTHONPATH=f"{ROOT}:{os.environ.get('PYTHONPATH', '')}")
        cmd = [sys.executable, "-m", "torch.distributed.run", f"--nproc-per-node={args.nproc}", f"--master-port={free_port()}",
               __file__, "--worker", str(work), "--steps", str(args.steps), "--warmup", str(args.warmup)]
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, text=True)
        if proc.returncode:
            sys.exit(f"the workers failed ({proc.returncode})")
        print("\n".join(line for line in proc.stdout.splitlines() if line.startswith("{")))


if __name__ == "__main__":
    main()
