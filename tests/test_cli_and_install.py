"""The installed tool end to end: a non-editable install finds its recipes and formats from any
directory, and `ftctl train` on the command line produces a complete run dir."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
SUBPROCESS_TIMEOUT = 600  # a hung command fails its test instead of stalling CI


def run_ftctl(*args, cwd=None, env=None):
    return subprocess.run([sys.executable, "-m", "ftctl", *args], capture_output=True, text=True, cwd=cwd,
                          env={**os.environ, **(env or {})}, timeout=SUBPROCESS_TIMEOUT)


@pytest.mark.slow
def test_non_editable_install_finds_recipes_and_formats_from_another_dir(tmp_path):
    site = tmp_path / "site"
    build = subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation", "--target", str(site), str(REPO)],
        capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT,
    )
    assert build.returncode == 0, build.stderr
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    env = {"PYTHONPATH": str(site)}
    probe = subprocess.run(
        [sys.executable, "-c",
         "import ftctl, data_formats; from ftctl.paths import recipes_dir, samples_dir; "
         "print(ftctl.__file__); print(recipes_dir()); print(samples_dir()); print(data_formats.available())"],
        capture_output=True, text=True, cwd=elsewhere, env={**os.environ, **env}, timeout=SUBPROCESS_TIMEOUT,
    )
    assert probe.returncode == 0, probe.stderr
    module_file, recipes, samples, formats = probe.stdout.splitlines()
    assert module_file.startswith(str(site)) and recipes == str(site / "ftctl" / "_recipes")
    assert samples == str(site / "data_formats" / "samples")
    assert "alpaca" in formats and "sharegpt" in formats
    listing = run_ftctl("recipes", cwd=elsewhere, env=env)
    assert "tiny_lora" in listing.stdout, listing.stderr
    shown = run_ftctl("train", "recipe=tiny_lora", "--cfg", cwd=elsewhere, env=env)
    assert f"path: {site / 'data_formats' / 'samples' / 'alpaca_sample.jsonl'}" in shown.stdout, shown.stderr


@pytest.mark.slow
def test_train_on_the_command_line_writes_a_complete_run_dir(tmp_path, tiny_model_dir):
    out = tmp_path / "run"
    args = ["train", "recipe=tiny_lora", f"model.name_or_path={tiny_model_dir}", f"output_dir={out}",
            "train.max_steps=4", "train.save_every=2", "precision=fp32", "train.progress_bar=false"]
    done = run_ftctl(*args)
    assert done.returncode == 0, done.stderr
    assert "done: 4 steps" in done.stdout
    assert (out / "config.yaml").is_file() and (out / "train.log").is_file()
    assert "max_steps: 4" in (out / "config.yaml").read_text()
    steps = [json.loads(line)["step"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]
    assert (out / "checkpoints" / "step-2" / "adapter_model.safetensors").is_file()
    assert (out / "final" / "adapter_model.safetensors").is_file()
    again = run_ftctl(*args)
    assert again.returncode == 1
    assert "is not empty" in again.stderr and "overwrite=true" in again.stderr and "Traceback" not in again.stderr


def test_data_preview_marks_spans(tiny_model_dir):
    shown = run_ftctl("data", "preview", "recipe=tiny_lora", "data=sharegpt_sample",
                      f"model.name_or_path={tiny_model_dir}", "n=2")
    assert shown.returncode == 0, shown.stderr
    assert shown.stdout.count("--- example") == 2
    assert "\u27e6" in shown.stdout and "<|im_start|>user" in shown.stdout


def test_missing_model_is_a_message(tmp_path):
    done = run_ftctl("train", "recipe=tiny_lora", f"model.name_or_path={tmp_path}/nope", f"output_dir={tmp_path}/r")
    assert done.returncode == 1
    assert "no such dir, alias or hub id" in done.stderr and "Traceback" not in done.stderr
    assert not (tmp_path / "r").exists()  # nothing half-written


def test_every_command_has_its_own_help_and_usage_errors(capsys):
    import pytest

    from ftctl.cli import build_parser, main

    for name in build_parser().command_parsers:
        with pytest.raises(SystemExit) as done:
            main([*name.split(), "--help"])
        assert done.value.code == 0
        assert capsys.readouterr().out.startswith(f"usage: ftctl {name} "), name
    with pytest.raises(SystemExit) as done:
        main(["train", "recipe=tiny_lora", "--dryrun"])
    assert done.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: ftctl train ") and "commands:" not in err
    assert "ftctl train: error: unrecognized arguments: --dryrun Did you mean '--dry-run'?" in err
    with pytest.raises(SystemExit):
        main(["train", "--nope"])
    assert capsys.readouterr().err.rstrip().endswith("unrecognized arguments: --nope")  # no far-fetched suggestion
    assert main(["data"]) == 2  # a group without its subcommand: the group's own help
    assert capsys.readouterr().out.startswith("usage: ftctl data ")


def test_output_piped_into_a_reader_that_quits_is_not_an_error():
    # `true` exits without reading, so ftctl's first flush meets a closed pipe.
    proc = subprocess.run(f"'{sys.executable}' -m ftctl config-docs | true", shell=True, capture_output=True, text=True,
                          timeout=SUBPROCESS_TIMEOUT)
    assert proc.stderr == "", proc.stderr


def test_a_broken_pipe_elsewhere_is_still_an_error(monkeypatch):
    import pytest

    import ftctl.cli as cli

    def failing(args):
        raise BrokenPipeError("a worker's pipe")

    monkeypatch.setattr(cli, "cmd_recipes", failing)
    with pytest.raises(BrokenPipeError):
        cli.main(["recipes"])


@pytest.mark.slow
def test_a_multi_process_full_fine_tune_prints_only_ftctl(tmp_path, tiny_model_dir):
    # Library chatter a user cannot act on stays out: transformers' FutureWarnings in every worker, and
    # DeepSpeed's "Setting accelerator to CPU" when transformers asks it about ZeRO-3 while saving.
    done = run_ftctl("train", "recipe=tiny_lora", f"model.name_or_path={tiny_model_dir}", f"output_dir={tmp_path / 'run'}",
                     "method=full", "parallel=ddp", "parallel.nproc_per_node=2", "train.max_steps=2", "precision=fp32", "train.progress_bar=false")
    assert done.returncode == 0, done.stderr
    for noise in ("FutureWarning", "Setting accelerator to CPU", "Traceback"):
        assert noise not in done.stderr, done.stderr
    assert all(line.startswith(("[ftctl] ", "done: ")) for line in done.stdout.splitlines()), done.stdout
