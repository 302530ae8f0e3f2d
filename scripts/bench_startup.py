#!/usr/bin/env python
"""Wall time of ftctl commands that only read configs, each in a fresh interpreter (median of N runs).

    .venv/bin/python scripts/bench_startup.py [--runs 5]

For scale it also times `python -c "import torch"` and `python -c "import torch, transformers, peft"`,
which is what these commands avoid. A shared, busy machine inflates everything; look at the ratios.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

COMMANDS = [
    ("ftctl --help", ["-m", "ftctl", "--help"]),
    ("ftctl recipes", ["-m", "ftctl", "recipes"]),
    ("ftctl train recipe=tiny_lora --cfg", ["-m", "ftctl", "train", "recipe=tiny_lora", "--cfg"]),
    ("ftctl train recipe=tiny_lora train.lr=-1 (config error)", ["-m", "ftctl", "train", "recipe=tiny_lora", "train.lr=-1"]),
    ("ftctl train recipe=llama7b_lora --dry-run", ["-m", "ftctl", "train", "recipe=llama7b_lora", "--dry-run"]),
    ("ftctl estimate recipe=llama7b_qlora --json", ["-m", "ftctl", "estimate", "recipe=llama7b_qlora", "--json"]),
    ("python -c 'import torch'", ["-c", "import torch"]),
    ("python -c 'import torch, transformers, peft'", ["-c", "import torch, transformers, peft"]),
]


def time_once(args, env) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, check=False)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--runs", type=int, default=5)
    args = parser.parse_args()
    env = dict(os.environ, FTCTL_HOME=os.environ.get("FTCTL_HOME") or tempfile.mkdtemp(prefix="ftctl-startup-"))
    print(f"median of {args.runs} runs, fresh interpreter each, {os.cpu_count()} CPUs, load average {os.getloadavg()[0]:.2f}\n")
    print("| command | median s | min s |\n|---|---:|---:|")
    for label, cmd in COMMANDS:
        time_once(cmd, env)  # warm the file cache
        times = [time_once(cmd, env) for _ in range(args.runs)]
        print(f"| `{label}` | {statistics.median(times):.2f} | {min(times):.2f} |", flush=True)


if __name__ == "__main__":
    main()
