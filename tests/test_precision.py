"""precision=auto: one rule (ftctl.precision.auto.auto_precision) for training, the estimator and dry runs,
decided by the CPU's bf16 support, which FTCTL_CPU_BF16 can force. `.ci/run` runs this file with the
probe forced each way, so both kinds of CPU are covered on whichever machine CI has."""

from __future__ import annotations

import logging

import pytest
import torch

from ftctl.cli import main
from ftctl.estimate import machine_precision
from ftctl.precision.auto import CPU_BF16_ENV, auto_precision, cpu_flags, cpu_has_native_bf16
from ftctl.precision.policy import resolve_precision_name

# auto means the GPU's precision on a machine with one: the CPU rule is tested on the CPU, a GPU host's GPU
# hidden (tests/devices.py).
pytestmark = [pytest.mark.precision, pytest.mark.usefixtures("on_cpu")]
CPU = torch.device("cpu")


@pytest.mark.parametrize("forced, expected", [("1", "bf16"), ("0", "fp32"), ("true", "bf16"), ("no", "fp32")])
def test_auto_follows_the_probe_on_each_kind_of_cpu(monkeypatch, forced, expected):
    monkeypatch.setenv(CPU_BF16_ENV, forced)
    assert cpu_has_native_bf16() == (expected == "bf16")
    assert resolve_precision_name("auto", CPU) == auto_precision("cpu") == expected
    assert resolve_precision_name("fp32", CPU) == "fp32" and resolve_precision_name("bf16", CPU) == "bf16"
    assert machine_precision("auto") == expected  # the estimator's answer is training's


def test_gpus_get_bf16_or_fp16_whatever_the_cpu(monkeypatch):
    monkeypatch.setenv(CPU_BF16_ENV, "0")
    assert auto_precision("cuda", cuda_bf16=True) == "bf16"
    assert auto_precision("cuda", cuda_bf16=False) == "fp16"
    assert auto_precision("mps") == "fp32"


@pytest.mark.parametrize("flags, native", [
    ("fpu sse avx2 avx512f avx512_bf16 avx512_vnni", True),
    ("fpu sse avx2 amx_bf16 amx_tile", True),
    ("fpu sse avx2 fma f16c", False),
])
def test_the_probe_reads_the_cpu_flags(tmp_path, monkeypatch, flags, native):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text(f"processor\t: 0\nflags\t\t: {flags}\n\nprocessor\t: 1\nflags\t\t: {flags}\n")
    assert ("avx512_bf16" in cpu_flags(str(cpuinfo)) or "amx_bf16" in cpu_flags(str(cpuinfo))) == native
    monkeypatch.delenv(CPU_BF16_ENV, raising=False)
    import ftctl.precision.auto as precision_auto

    monkeypatch.setattr(precision_auto, "cpu_flags", lambda: cpu_flags(str(cpuinfo)))
    assert precision_auto.cpu_has_native_bf16() == native
    assert auto_precision("cpu") == ("bf16" if native else "fp32")


def test_a_bad_override_is_one_line(monkeypatch, capsys, tmp_path):
    monkeypatch.setenv(CPU_BF16_ENV, "maybe")
    assert main(["train", "recipe=tiny_lora", f"output_dir={tmp_path / 'never'}", "--dry-run"]) in (1, 2)
    err = capsys.readouterr().err
    assert err.startswith("ftctl: error: FTCTL_CPU_BF16='maybe': expected 1, 0 or auto"), err
    assert len(err.strip().splitlines()) == 1


def test_auto_trains_plans_and_estimates_in_what_the_probe_says(make_cfg, run_training, caplog, capsys, tmp_path):
    """Run under the environment's probe: forced to bf16 and to fp32 by `.ci/run`, the machine's own otherwise."""
    expected = "bf16" if cpu_has_native_bf16() else "fp32"
    caplog.set_level(logging.INFO, logger="ftctl")
    result, metrics = run_training(make_cfg("precision=auto", "train.max_steps=1", "method.r=4"))
    assert f"precision={expected} " in caplog.text
    assert all(p.dtype == torch.float32 for p in result.model.parameters() if p.requires_grad)  # master weights
    assert main(["train", "recipe=tiny_lora", f"output_dir={tmp_path / 'planned'}", "--dry-run"]) == 0
    assert f"auto -> {expected} on this machine" in capsys.readouterr().out
    assert machine_precision("auto") == expected
