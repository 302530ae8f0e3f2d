"""Measure how much process memory real ftctl training runs add, next to ftctl's estimate for them.

Run by tests/test_estimate.py in a fresh process: python tests/memory_probe.py WORK_DIR CONFIG...
where each CONFIG is a space-separated list of overrides. Prints one JSON line per config.

The increase is the resident-set high-water mark (VmHWM) during training minus the resident set
just before the model is built; the high-water mark is reset at that moment (Linux clear_refs), so
what came before (imports, tokenising) does not count. The caller sets MALLOC_MMAP_THRESHOLD_ so
that freed tensors go back to the system instead of staying in the allocator's pools. A first,
unmeasured run pays the one-time costs (lazy imports inside transformers and peft, thread pools).
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
from pathlib import Path

WORDS = "alpha beta gamma delta epsilon zeta theta kappa lambda sigma omega".split()


def status_bytes(key: str) -> int:
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {key}")


def reset_peak() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


@contextlib.contextmanager
def training_memory(runner, metrics_logger):
    """While active, every training run through ``runner`` fills the yielded dict: "before", the resident set
    when the model starts to build (the high-water mark reset there), and "peak", the high-water mark of the
    training itself: at the end of the loop, and before each checkpoint (whose gathered copy of the weights is
    host memory on a GPU machine, and is not training memory; the mark is reset after it), the larger.
    The final save comes after the loop and is not counted either."""
    marks = {}
    real_create_method, real_close, real_checkpoint = runner.create_method, metrics_logger.close, runner.save_checkpoint

    def create_method(cfg, *args):
        method = real_create_method(cfg, *args)
        real_build = method.build_model

        def build_model(*args, **kwargs):
            gc.collect()
            marks["before"] = status_bytes("VmRSS")
            marks["peak"] = 0
            reset_peak()
            return real_build(*args, **kwargs)

        method.build_model = build_model
        return method

    def save_checkpoint(*args, **kwargs):
        marks["peak"] = max(marks.get("peak", 0), status_bytes("VmHWM"))
        try:
            return real_checkpoint(*args, **kwargs)
        finally:
            gc.collect()
            reset_peak()

    def close(self):
        marks["peak"] = max(marks.get("peak", 0), status_bytes("VmHWM"))
        real_close(self)

    runner.create_method, metrics_logger.close, runner.save_checkpoint = create_method, close, save_checkpoint
    try:
        yield marks
    finally:
        runner.create_method, metrics_logger.close, runner.save_checkpoint = real_create_method, real_close, real_checkpoint


def main() -> None:
    work = Path(sys.argv[1])
    work.mkdir(parents=True, exist_ok=True)
    os.environ["FTCTL_HOME"] = str(work / "home")

    from ftctl.models.tiny import build_tiny_llama

    model_dir = build_tiny_llama(
        work / "model", num_layers=4, hidden_size=256, num_heads=4, num_kv_heads=2, intermediate_size=768, vocab_size=512
    )
    data = work / "long.jsonl"
    with open(data, "w") as f:  # every example is longer than max_seq_len, so every micro-batch is full
        for k in range(64):
            f.write(json.dumps({
                "instruction": " ".join(WORDS[(k + j) % 11] for j in range(20)),
                "input": "",
                "output": " ".join(WORDS[(k * 3 + j) % 11] for j in range(200)),
            }) + "\n")

    import ftctl.training.runner as runner
    from ftctl.config.compose import compose_config
    from ftctl.estimate import estimate_for
    from ftctl.training.metrics import MetricsLogger
    from ftctl.training.run_dir import prepare_run_dir

    base = [
        "recipe=tiny_lora", f"model.name_or_path={model_dir}", "precision=fp32", f"data.path={data}",
        "data.max_seq_len=128", "data.train_on_prompt=true", "train.micro_batch_size=4", "train.global_batch_size=8",
        # Two steps: the second one holds the optimizer states the first one created.
        "train.max_steps=2", "train.progress_bar=false", "train.tensorboard=false", "overwrite=true",
    ]
    warm_up = "method=lora train.max_steps=1 train.micro_batch_size=2 train.global_batch_size=2 data.max_seq_len=64"
    configs = [warm_up] + sys.argv[2:]
    with training_memory(runner, MetricsLogger) as marks:
        for i, extra in enumerate(configs):
            cfg = compose_config(base + [f"output_dir={work / f'run{i}'}"] + extra.split())
            estimate = estimate_for(cfg)
            runner.train(cfg, prepare_run_dir(cfg))
            gc.collect()
            if i == 0:
                continue
            print(json.dumps({
                "config": extra,
                "measured_increase": marks["peak"] - marks["before"],
                "estimate": estimate.to_dict(),
            }), flush=True)


if __name__ == "__main__":
    main()
