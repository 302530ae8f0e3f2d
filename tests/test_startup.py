"""Commands that only read configs answer without importing torch (or transformers): each runs in a
fresh interpreter, which then reports the heavy modules it loaded. Wall times: scripts/bench_startup.py."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

HEAVY = ("torch", "transformers", "peft", "deepspeed", "accelerate")

PROBE = """
import json, sys
from ftctl.cli import main
try:
    code = main(sys.argv[1:])
except SystemExit as exc:  # argparse's --help
    code = exc.code
print("\\n" + json.dumps({"code": code, "heavy": [m for m in %r if m in sys.modules]}))
""" % (HEAVY,)


def run_cli(*argv, env=None):
    proc = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=120, env=env)
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    return report, proc


@pytest.mark.parametrize(
    "argv, code",
    [
        (["--help"], 0),
        (["recipes"], 0),
        (["recipes", "show", "tiny_lora"], 0),
        (["config-docs"], 0),
        (["train", "recipe=tiny_lora", "--cfg"], 0),
        (["train", "recipe=llama7b_lora", "--dry-run"], 0),
        (["train", "recipe=tiny_lora", "data.path=/nonexistent.jsonl", "--dry-run"], 1),  # a preflight refusal
        (["estimate", "recipe=llama7b_qlora", "--json"], 0),
        (["train", "recipe=tiny_lora", "train.lr=-1"], 2),  # a config error
        (["train", "recipe=tiny_lora", "train.lrr=1e-4"], 2),  # an unknown key
    ],
    ids=lambda v: " ".join(v) if isinstance(v, list) else str(v),
)
def test_config_only_commands_do_not_import_torch(argv, code, tmp_path):
    env = dict(os.environ, FTCTL_HOME=str(tmp_path / "home"))
    report, proc = run_cli(*argv, env=env)
    assert report["code"] == code, proc.stderr[-2000:]
    assert report["heavy"] == [], f"`ftctl {' '.join(argv)}` imported {report['heavy']}"
    if code:
        assert proc.stderr.startswith("ftctl: error: ") and "Traceback" not in proc.stderr
