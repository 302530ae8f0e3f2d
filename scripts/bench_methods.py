"""Benchmark the four methods on the demo task with one budget: held-out score, train time, peak RSS, trainable parameters.

    python scripts/bench_methods.py [--methods full,lora,qlora,dora] [--steps N] [--n 50]

Each method trains with `ftctl train recipe=smollm2_demo method=M` (same data, steps, batch and seed;
full fine-tuning with its own, lower learning rate) and is scored with `ftctl eval` on the demo's
held-out split. Train time is the wall time of the train command (model load included); peak RSS is
that process's maximum resident memory. The table goes to stdout and to <out-dir>/methods.md.
This is a benchmark, not a test: it takes a while and its numbers depend on the machine.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RECIPE = "smollm2_demo"
#: Overrides per method on top of the recipe; adapters share the recipe's learning rate.
METHOD_OVERRIDES = {
    "full": ["method=full", "train.lr=1e-4"],
    "lora": ["method=lora"],
    "qlora": ["method=qlora"],
    "dora": ["method=dora"],
}


def ftctl() -> list:
    installed = Path(sys.executable).with_name("ftctl")
    return [str(installed)] if installed.is_file() else [sys.executable, "-m", "ftctl"]


def run_measured(args: list, log_path: Path):
    """(exit code, wall seconds, peak RSS in MiB) of one ftctl command, its output kept in log_path."""
    start = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(ftctl() + args, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return proc.returncode, time.perf_counter() - start, usage.ru_maxrss / 1024  # Linux reports KiB


def trainable_parameters(train_log: str) -> str:
    match = re.search(r"trainable ([\d,]+) of ([\d,]+) params", train_log)
    if not match:
        return "?"
    trainable, total = (int(x.replace(",", "")) for x in match.groups())
    return f"{trainable / 1e6:.2f}M ({100 * trainable / total:.2f}%)"


def bench(method: str, out_dir: Path, steps, n: int) -> dict:
    run_dir = out_dir / method
    train_args = ["train", f"recipe={RECIPE}", *METHOD_OVERRIDES[method], f"output_dir={run_dir}",
                  "overwrite=true", "train.progress_bar=false"]
    if steps:
        train_args.append(f"train.max_steps={steps}")
    print(f"[bench] {method}: ftctl {' '.join(train_args)}", flush=True)
    code, seconds, rss = run_measured(train_args, out_dir / f"{method}.train.log")
    train_log = (out_dir / f"{method}.train.log").read_text()
    if code != 0:
        reason = next((line for line in reversed(train_log.splitlines()) if line.strip()), "?")
        return {"method": method, "error": reason}
    target = f"model={run_dir}" if method == "full" else f"adapter={run_dir}"
    eval_args = ["eval", f"recipe={RECIPE}", target, "max_new_tokens=40", f"output={run_dir / 'eval'}"] + ([f"n={n}"] if n else [])
    code, eval_seconds, _ = run_measured(eval_args, out_dir / f"{method}.eval.log")
    if code != 0:
        return {"method": method, "error": "eval failed: see " + str(out_dir / f"{method}.eval.log")}
    summary = json.loads((run_dir / "eval" / "eval.json").read_text())
    losses = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    final_loss = next((r["loss"] for r in reversed(losses) if "loss" in r), float("nan"))
    return {
        "method": method, "score": summary["score"], "metric": summary["metric"], "n": summary["n"],
        "train_s": seconds, "rss_mib": rss, "trainable": trainable_parameters(train_log),
        "final_loss": final_loss, "eval_s": eval_seconds,
    }


def table(rows: list, baseline) -> str:
    metric = next((r["metric"] for r in rows if "metric" in r), "score")
    lines = [f"| method | held-out {metric} | train time | peak RSS | trainable params | final train loss |",
             "|---|---|---|---|---|---|"]
    if baseline is not None:
        lines.append(f"| (base model, no training) | {baseline:.2f} | – | – | – | – |")
    for r in rows:
        if "error" in r:
            lines.append(f"| {r['method']} | not run: {r['error']} | | | | |")
        else:
            lines.append(f"| {r['method']} | {r['score']:.2f} | {r['train_s']:.0f} s | {r['rss_mib']:.0f} MiB "
                         f"| {r['trainable']} | {r['final_loss']:.4f} |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", default="full,lora,qlora,dora")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default: the recipe's)")
    parser.add_argument("--n", type=int, default=0, help="held-out examples to score (default: all 50)")
    parser.add_argument("--out-dir", default="runs/bench_methods")
    parser.add_argument("--baseline", action="store_true", help="also score the untrained base model")
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    out_dir = (ROOT / args.out_dir) if not Path(args.out_dir).is_absolute() else Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    methods = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = [m for m in methods if m not in METHOD_OVERRIDES]
    if unknown:
        sys.exit(f"bench_methods: unknown method(s) {', '.join(unknown)}; choose from {', '.join(METHOD_OVERRIDES)}")

    baseline = None
    if args.baseline:
        code, _, _ = run_measured(["eval", f"recipe={RECIPE}", "max_new_tokens=40", f"output={out_dir / 'base_eval'}"]
                                  + ([f"n={args.n}"] if args.n else []), out_dir / "base.eval.log")
        if code == 0:
            baseline = json.loads((out_dir / "base_eval" / "eval.json").read_text())["score"]
    rows = []
    for method in methods:
        rows.append(bench(method, out_dir, args.steps, args.n))
        print(table(rows, baseline), flush=True)
    text = table(rows, baseline)
    (out_dir / "methods.md").write_text(text)
    (out_dir / "methods.json").write_text(json.dumps(rows, indent=2) + "\n")
    print(f"[bench] table written to {out_dir / 'methods.md'}")


if __name__ == "__main__":
    main()
