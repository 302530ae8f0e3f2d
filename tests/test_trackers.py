"""Trackers (train.report_to) and the loss plot, driven through the CLI and read back with each tracker's own client."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ftctl.cli import main
from ftctl.training.metrics import read_metrics

ROOT = Path(__file__).resolve().parent.parent
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _offline_env(tmp_path: Path) -> dict:
    """No W&B credentials and no tracker settings from the developer's shell: ftctl must choose offline itself."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "MLFLOW_"))}
    env.update(PYTHONPATH=str(ROOT), NETRC=str(tmp_path / "no-netrc"), OMP_NUM_THREADS="1")
    return env


def _wandb_history(run_dir: Path) -> list:
    """The history rows of the run's offline .wandb file, read by wandb's own reader (`wandb leet inspect`)."""
    (wandb_file,) = run_dir.glob("wandb/offline-run-*/run-*.wandb")  # one run: rank 0's
    out = subprocess.run([sys.executable, "-m", "wandb", "leet", "inspect", "--json", str(wandb_file)],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    records = [json.loads(line) for line in out.splitlines() if line.startswith("{")]
    return [r["history"] for r in records if r.get("type") == "history"]


@pytest.mark.slow
def test_train_reports_every_metric_to_wandb_and_mlflow_from_rank_0_and_draws_the_curve(tiny_model_dir, tmp_path, monkeypatch):
    pytest.importorskip("wandb")
    mlflow_tracking = pytest.importorskip("mlflow.tracking")
    pytest.importorskip("matplotlib")
    run_dir = tmp_path / "run"
    command = [sys.executable, "-m", "ftctl", "train", "recipe=tiny_lora", f"model.name_or_path={tiny_model_dir}",
               f"output_dir={run_dir}", "precision=fp32", "train.max_steps=4", "train.eval_every=2", "data.eval_fraction=0.2",
               "parallel=ddp", "parallel.nproc_per_node=2",  # two ranks, one reporter
               "train.progress_bar=false", "train.num_threads=1", "train.report_to=[wandb,mlflow]"]
    result = subprocess.run(command, capture_output=True, text=True, timeout=600, env=_offline_env(tmp_path))
    assert result.returncode == 0, result.stderr[-3000:]
    assert "wandb: run" in result.stdout and "offline" in result.stdout
    assert not (run_dir / "tensorboard").exists()  # report_to replaces the default [tensorboard]

    lines = read_metrics(run_dir)
    train_lines = [m for m in lines if "loss" in m]
    eval_lines = [m for m in lines if "eval_loss" in m]
    assert [m["step"] for m in train_lines] == [1, 2, 3, 4] and [m["step"] for m in eval_lines] == [2, 4]

    # MLflow: the file store in the run dir, read through MlflowClient (which, like `mlflow ui`, asks for this opt-in).
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    client = mlflow_tracking.MlflowClient(tracking_uri=(run_dir / "mlruns").resolve().as_uri())
    run_id = json.loads((run_dir / "trackers.json").read_text())["mlflow"]
    assert [r.info.run_id for e in client.search_experiments() for r in client.search_runs([e.experiment_id])] == [run_id]
    run = client.get_run(run_id)
    assert run.info.status == "FINISHED"
    assert run.data.params["train.max_steps"] == "4" and run.data.params["precision.name"] == "fp32"
    history = {m.step: m.value for m in client.get_metric_history(run_id, "train/loss")}
    assert history == pytest.approx({m["step"]: m["loss"] for m in train_lines}, rel=1e-6)
    evals = {m.step: m.value for m in client.get_metric_history(run_id, "eval/eval_loss")}
    assert evals == pytest.approx({m["step"]: m["eval_loss"] for m in eval_lines}, rel=1e-6)
    # Every numeric field of a metrics line is forwarded, whatever it is called.
    numeric = {k for m in lines for k, v in m.items() if k != "step" and isinstance(v, (int, float)) and not isinstance(v, bool)}
    assert {"tokens_per_s", "grad_norm", "lr", "eval_loss"} <= numeric
    logged = set(run.data.metrics)
    assert {("eval/" if k.startswith("eval") else "train/") + k for k in numeric} <= logged

    # W&B: the offline run file in the run dir, read by wandb.
    rows = _wandb_history(run_dir)
    wandb_losses = {row["item"]["_step"]: row["item"]["train/loss"] for row in rows if "train/loss" in row["item"]}
    assert wandb_losses == pytest.approx({m["step"]: m["loss"] for m in train_lines}, rel=1e-6)
    wandb_keys = {key for row in rows for key in row["item"]}
    assert {"train/tokens_per_s", "eval/eval_loss", "train/grad_norm"} <= wandb_keys

    curve = run_dir / "loss_curve.png"
    assert curve.read_bytes()[:8] == PNG_MAGIC


def test_plot_redraws_the_curve_of_a_run(make_cfg, run_training, tmp_path, capsys):
    pytest.importorskip("matplotlib")
    result, metrics = run_training(make_cfg("train.max_steps=3", "precision=fp32"))
    curve = result.run_dir / "loss_curve.png"
    assert not curve.exists()  # the test config turns the end-of-run plot off (train.plot=false)
    assert main(["plot", str(result.run_dir)]) == 0
    assert curve.read_bytes()[:8] == PNG_MAGIC
    elsewhere = tmp_path / "curve.png"
    assert main(["plot", str(result.run_dir), f"output={elsewhere}"]) == 0
    assert elsewhere.read_bytes()[:8] == PNG_MAGIC
    capsys.readouterr()
    assert main(["plot", str(tmp_path / "nothing")]) != 0
    assert "no metrics.jsonl" in capsys.readouterr().err


def test_train_draws_the_curve_at_the_end_unless_told_not_to(make_cfg, run_training):
    pytest.importorskip("matplotlib")
    result, _ = run_training(make_cfg("train.max_steps=2", "precision=fp32", "train.plot=true"))
    assert (result.run_dir / "loss_curve.png").read_bytes()[:8] == PNG_MAGIC


def test_tensorboard_is_the_default_tracker_and_the_old_switch_still_turns_it_off(make_cfg):
    from ftctl.config.compose import compose_config
    from ftctl.training.trackers import requested_trackers

    assert requested_trackers(compose_config(["recipe=tiny_lora"]).train) == ["tensorboard"]
    assert requested_trackers(compose_config(["recipe=tiny_lora", "train.tensorboard=false"]).train) == []
    both = compose_config(["recipe=tiny_lora", "train.report_to=[tensorboard,mlflow]", "train.tensorboard=false"])
    assert requested_trackers(both.train) == ["mlflow"]


def test_an_unknown_tracker_is_one_line_naming_the_choices(capsys):
    assert main(["train", "recipe=tiny_lora", "train.report_to=[wandb,comet]", "--cfg"]) == 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "train.report_to='comet'" in err and "tensorboard, wandb, mlflow" in err


def test_a_tracker_that_is_not_installed_is_refused_before_the_run_starts(monkeypatch, tmp_path, capsys):
    from ftctl.training import trackers

    monkeypatch.setitem(trackers.TRACKER_PACKAGES, "mlflow", "ftctl_no_such_module")
    out = tmp_path / "run"
    assert main(["train", "recipe=tiny_lora", f"output_dir={out}", "train.report_to=[mlflow]"]) != 0
    assert "pip install 'ftctl[track]'" in capsys.readouterr().err
    assert not out.exists()


def test_wandb_goes_offline_without_credentials_or_network(monkeypatch, tmp_path):
    from ftctl.training.trackers import wandb_mode

    for key in ("WANDB_MODE", "WANDB_API_KEY"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("NETRC", str(tmp_path / "none"))
    assert wandb_mode() == "offline"  # no credentials
    monkeypatch.setenv("WANDB_API_KEY", "x" * 40)
    monkeypatch.setenv("WANDB_BASE_URL", "http://127.0.0.1:9")  # nothing listens on the discard port
    assert wandb_mode() == "offline"
    monkeypatch.setenv("WANDB_MODE", "disabled")
    assert wandb_mode() == "disabled"


def test_a_resumed_run_continues_its_mlflow_run(make_cfg, run_training, monkeypatch):
    mlflow_tracking = pytest.importorskip("mlflow.tracking")
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    monkeypatch.delenv("MLFLOW_EXPERIMENT_NAME", raising=False)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    first, _ = run_training(make_cfg("train.max_steps=4", "train.save_every=2", "precision=fp32", "train.report_to=[mlflow]"))
    run_id = json.loads((first.run_dir / "trackers.json").read_text())["mlflow"]
    shutil.rmtree(first.final_dir)  # as if it had stopped after its step-2 checkpoint
    shutil.rmtree(first.run_dir / "checkpoints" / "step-4")
    run_training(make_cfg("train.max_steps=4", "train.save_every=2", "precision=fp32", "train.report_to=[mlflow]", "resume=auto"))
    assert json.loads((first.run_dir / "trackers.json").read_text())["mlflow"] == run_id
    client = mlflow_tracking.MlflowClient(tracking_uri=(first.run_dir / "mlruns").resolve().as_uri())
    (experiment,) = [e for e in client.search_experiments() if e.name == "ftctl"]
    assert [r.info.run_id for r in client.search_runs([experiment.experiment_id])] == [run_id]
    steps = [m.step for m in client.get_metric_history(run_id, "train/loss")]
    assert sorted(steps) == [1, 2, 3, 3, 4, 4]  # steps 3 and 4 again, from the resumed process
    assert client.get_run(run_id).info.status == "FINISHED"

