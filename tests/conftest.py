"""Shared fixtures: an isolated FTCTL_HOME, one tiny random Llama per session, a config builder, and a
guard that keeps the suite independent of the CPU's bf16 support."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Tiny models gain nothing from intra-op threads, and on a busy 2-core machine OpenMP's spinning
# threads make them many times slower; distributed tests start one single-threaded worker per core.
os.environ.setdefault("OMP_NUM_THREADS", "1")


@pytest.fixture(scope="session", autouse=True)
def ftctl_home(tmp_path_factory) -> Path:
    home = tmp_path_factory.mktemp("ftctl_home")
    os.environ["FTCTL_HOME"] = str(home)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    return home


@pytest.fixture(autouse=True)
def precision_auto_only_where_marked(request, monkeypatch):
    """`precision=auto` means bf16 on CPUs with native bf16 and fp32 elsewhere, so a test that lets the
    CPU probe decide tests a different thing on each machine. Such a test names its precision, or is
    marked `precision` and sets the probe itself (FTCTL_CPU_BF16); `.ci/run` runs those both ways."""
    if request.node.get_closest_marker("precision"):
        return
    import ftctl.precision.auto as precision_auto

    def unexpected_probe():
        pytest.fail("this test let precision=auto ask the CPU for bf16: pass precision=fp32 (or bf16) explicitly, "
                    "or mark it @pytest.mark.precision and set FTCTL_CPU_BF16", pytrace=False)

    monkeypatch.setattr(precision_auto, "cpu_has_native_bf16", unexpected_probe)


@pytest.fixture
def on_cpu():
    """This test runs on the CPU on any machine (see tests/devices.py)."""
    from devices import cpu_only

    with cpu_only():
        yield


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A 2-layer random Llama with a ChatML tokenizer (pad token distinct from EOS)."""
    from ftctl.models.tiny import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny_llama"))


@pytest.fixture(scope="session")
def tiny_model_no_template_dir(tmp_path_factory) -> Path:
    """A tiny Llama whose tokenizer has no chat template and pads with EOS (the fallback-template path)."""
    from ftctl.models.tiny import build_tiny_llama

    return build_tiny_llama(tmp_path_factory.mktemp("tiny_llama_plain"), chat_template=False, pad_token=False)


@pytest.fixture
def make_cfg(tiny_model_dir, tmp_path):
    """compose_config with the tiny model, fp32, a fresh output dir and quiet logging; extra overrides win."""
    from ftctl.config.compose import compose_config

    def build(*overrides: str, model_dir: Path | None = None):
        base = [
            "recipe=tiny_lora",
            f"model.name_or_path={model_dir or tiny_model_dir}",
            f"output_dir={tmp_path / 'run'}",
            "precision=fp32",
            "train.progress_bar=false",
            "train.tensorboard=false",
            "train.plot=false",
        ]
        return compose_config(base + list(overrides))

    return build


@pytest.fixture
def run_training():
    """Train a composed config in this process; returns (TrainResult, metrics list)."""
    from ftctl.training.metrics import read_metrics
    from ftctl.training.run_dir import prepare_run_dir
    from ftctl.training.runner import train

    def run(cfg):
        run_dir = prepare_run_dir(cfg)
        result = train(cfg, run_dir)
        return result, read_metrics(run_dir)

    return run
