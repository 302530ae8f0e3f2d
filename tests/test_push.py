"""`ftctl push`: the model card written from a run, and the refusals. No test reaches a network: the hub probe's
connection is faked, and so is huggingface_hub's API where an upload is followed through."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
import yaml

from ftctl.errors import FtctlError

SHORT_RUN = ("train.max_steps=4", "train.global_batch_size=4", "train.warmup_steps=0", "train.log_every=1",
             "train.eval_every=2", "data.eval_fraction=0.25", "train.save_every=2")


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    """A finished tiny LoRA run with eval losses, a checkpoint every 2 steps and (with matplotlib) its loss curve."""
    import importlib.util

    from ftctl.config.compose import compose_config
    from ftctl.models.tiny import build_tiny_llama
    from ftctl.training.run_dir import prepare_run_dir
    from ftctl.training.runner import train

    root = tmp_path_factory.mktemp("push")
    cfg = compose_config(["recipe=tiny_lora", f"model.name_or_path={build_tiny_llama(root / 'model')}", f"output_dir={root / 'run'}",
                          "precision=fp32", "train.progress_bar=false", "train.tensorboard=false",
                          f"train.plot={str(importlib.util.find_spec('matplotlib') is not None).lower()}", *SHORT_RUN])
    run = prepare_run_dir(cfg)
    train(cfg, run)
    return run


def card_of(text: str):
    from huggingface_hub import ModelCard

    return ModelCard(text)


def test_card_states_base_method_data_metrics_curve_and_config(run_dir):
    from ftctl.push import CONFIG_NAME, METRICS_NAME, resolve_source, upload_plan
    from ftctl.training.metrics import read_metrics

    source = resolve_source(str(run_dir))
    assert source.result == run_dir / "final" and source.step is None
    plan = upload_plan(source, "someone/tiny-lora")
    card = card_of(plan["README.md"].decode())
    assert card.data.to_dict() == {"library_name": "peft", "pipeline_tag": "text-generation", "tags": ["ftctl", "lora", "peft"]}

    rows = read_metrics(run_dir)
    last_loss = [r["loss"] for r in rows if "loss" in r][-1]
    last_eval = [r["eval_loss"] for r in rows if "eval_loss" in r][-1]
    text = card.text
    config = (run_dir / "config.yaml").read_text()
    assert "LoRA (r=8, alpha=16.0, on all-linear) of `" in text and "a PEFT adapter" in text
    assert "`alpaca_sample.jsonl` (a local file)" in text and "Held-out data: 25% of the training sources." in text
    assert f"| final train loss | {last_loss:.4f} |" in text and f"| final held-out loss | {last_eval:.4f} |" in text
    assert "| optimizer steps | 4 |" in text and f"| 2 | {[r['loss'] for r in rows if r['step'] == 2 and 'loss' in r][0]:.4f} |" in text
    assert f"```yaml\n{config.rstrip()}\n```" in text
    assert plan[CONFIG_NAME].decode() == config and plan[METRICS_NAME].decode().count("\n") == len(rows)
    assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json"} <= set(plan)
    if (run_dir / "loss_curve.png").is_file():
        assert plan["loss_curve.png"] == run_dir / "loss_curve.png" and "![loss curve](loss_curve.png)" in text


def test_card_names_a_hub_base_and_hub_datasets_in_its_metadata(run_dir, tmp_path):
    """A base the Hub knows (an id, or an alias's origin) is the card's base_model; hub datasets are its datasets."""
    import shutil

    from ftctl.push import resolve_source, upload_plan

    for base, expected in (("smollm2-135m-instruct", "HuggingFaceTB/SmolLM2-135M-Instruct"), ("Qwen/Qwen2.5-0.5B", "Qwen/Qwen2.5-0.5B")):
        copy = tmp_path / base.replace("/", "_")
        shutil.copytree(run_dir, copy)
        config = yaml.safe_load((copy / "config.yaml").read_text())
        config["model"]["name_or_path"] = base
        config["data"]["mixture"] = [{"path": "hf://org/chats", "weight": 3}, {"path": "/data/mine.jsonl", "weight": 1}]
        (copy / "config.yaml").write_text(yaml.safe_dump(config))
        card = card_of(upload_plan(resolve_source(str(copy)), "me/x")["README.md"].decode())
        assert card.data.base_model == expected and card.data.datasets == ["org/chats"]
        assert f"of [{expected}](https://huggingface.co/{expected})" in card.text
        assert "[org/chats](https://huggingface.co/datasets/org/chats), weight 3" in card.text and "`mine.jsonl` (a local file), weight 1" in card.text


def test_a_checkpoint_is_pushed_without_its_training_state(run_dir):
    from ftctl.push import resolve_source, upload_plan

    source = resolve_source(str(run_dir / "checkpoints" / "step-2"))
    assert source.step == 2 and source.run_dir == run_dir
    plan = upload_plan(source, "me/x")
    assert "adapter_model.safetensors" in plan
    assert not [name for name in plan if name.endswith(".pt") or name == "trainer_state.json" or name == "loss_curve.png"]
    text = plan["README.md"].decode()
    assert "This is the checkpoint of step 2." in text and "| optimizer steps | 2 |" in text and "| 4 |" not in text


def test_a_merged_result_names_its_run(run_dir, tmp_path, capsys):
    from ftctl.cli import main

    merged = tmp_path / "merged"
    merged.mkdir()
    (merged / "model.safetensors").write_bytes(b"x")
    (merged / "config.json").write_text("{}")
    assert main(["push", str(merged), "me/x", "dry_run=true"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("ftctl: error: push:") and "run=RUN_DIR" in err and err.count("\n") == 1
    assert main(["push", str(merged), "me/x", f"run={run_dir}", "dry_run=true"]) == 0
    out = capsys.readouterr().out
    assert "library_name: transformers" in out and "a full transformers model" in out and "  model.safetensors" in out


def test_dry_run_prints_the_card_and_contacts_nothing(run_dir, monkeypatch, capsys):
    from ftctl.cli import main

    def no_network(*args, **kwargs):
        raise AssertionError("dry_run must not contact the Hub")

    monkeypatch.setattr("ftctl.models.hub.hub_unreachable_reason", no_network)
    monkeypatch.setattr("huggingface_hub.HfApi.create_repo", no_network)
    assert main(["push", str(run_dir), "me/tiny", "dry_run=true"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("---\nlibrary_name: peft") and "--- would upload to me/tiny:" in out and "  README.md" in out


@pytest.mark.parametrize("probe", ["refused", "black-holed"])
def test_without_network_push_fails_in_one_line_within_two_seconds(probe, run_dir, monkeypatch, capsys):
    """A refused connection answers at once; one into a black hole is abandoned after the probe's 1.5 s."""
    import socket

    from ftctl.cli import main
    from ftctl.models import hub

    def connect(*args, **kwargs):
        if probe == "black-holed":
            time.sleep(10)
        raise OSError("Network is unreachable")

    def no_upload(*args, **kwargs):
        raise AssertionError("nothing may be uploaded without network")

    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    monkeypatch.delenv("TRANSFORMERS_OFFLINE", raising=False)
    monkeypatch.setattr(socket, "create_connection", connect)
    monkeypatch.setattr("huggingface_hub.HfApi.create_repo", no_upload)
    hub.hub_reachable.cache_clear()
    started = time.perf_counter()
    try:
        assert main(["push", str(run_dir), "me/tiny"]) == 1
    finally:
        hub.hub_reachable.cache_clear()
    elapsed = time.perf_counter() - started
    err = capsys.readouterr().err
    assert elapsed < 2.0, elapsed
    assert err.startswith("ftctl: error: push: the Hugging Face Hub cannot be reached (") and "nothing was uploaded" in err
    assert err.count("\n") == 1 and "Traceback" not in err


def test_hf_hub_offline_refuses_at_once(run_dir, monkeypatch, capsys):
    from ftctl.cli import main

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    assert main(["push", str(run_dir), "me/tiny"]) == 1
    assert "cannot be reached (HF_HUB_OFFLINE is set); nothing was uploaded" in capsys.readouterr().err


def test_upload_sends_the_card_and_files_in_one_commit(run_dir, monkeypatch):
    """The Hub calls, faked: the card validated, the repo created as asked, one commit with every planned file."""
    from huggingface_hub import HfApi, ModelCard

    from ftctl.push import push

    calls = []
    monkeypatch.setattr("ftctl.models.hub.hub_unreachable_reason", lambda *a: None)
    monkeypatch.setattr(ModelCard, "validate", lambda self, *a, **k: calls.append(("validate", self.data.to_dict())))
    monkeypatch.setattr(HfApi, "create_repo", lambda self, repo_id, **k: calls.append(("create_repo", repo_id, k)) or f"https://hub/{repo_id}")
    monkeypatch.setattr(HfApi, "create_branch", lambda self, repo_id, **k: calls.append(("create_branch", repo_id, k)))

    class Commit:
        commit_url = "https://hub/me/tiny/commit/1"

    def create_commit(self, repo_id, operations, **kwargs):
        calls.append(("create_commit", repo_id, {op.path_in_repo: op for op in operations}, kwargs))
        return Commit()

    monkeypatch.setattr(HfApi, "create_commit", create_commit)
    assert push(str(run_dir), "me/tiny", {"private": "true", "revision": "v1"}) == Commit.commit_url
    kinds = [call[0] for call in calls]
    assert kinds == ["validate", "create_repo", "create_branch", "create_commit"]
    assert calls[1][2]["private"] is True and calls[2][2]["branch"] == "v1"
    _, repo_id, operations, kwargs = calls[3]
    assert repo_id == "me/tiny" and kwargs["revision"] == "v1" and "lora fine-tune of" in kwargs["commit_message"]
    assert {"README.md", "adapter_model.safetensors", "ftctl_config.yaml", "ftctl_metrics.jsonl"} <= set(operations)
    assert operations["README.md"].path_or_fileobj.startswith(b"---\nlibrary_name: peft")
    assert Path(operations["adapter_model.safetensors"].path_or_fileobj) == run_dir / "final" / "adapter_model.safetensors"


@pytest.mark.parametrize(
    "args, message",
    [
        (["/nonexistent/run", "me/x"], "push: /nonexistent/run: no such run dir"),
        (["RUN", "not a repo"], "push: REPO_ID not a repo is not a Hub repo id"),
        (["RUN", "me/x", "privat=true"], "unknown push option 'privat'. Did you mean 'private'?"),
        (["RUN", "me/x", "private=maybe"], "private=maybe: expected true or false"),
    ],
)
def test_push_arguments_are_checked_in_one_line(args, message, run_dir, capsys):
    from ftctl.cli import main

    assert main(["push", *[str(run_dir) if a == "RUN" else a for a in args]]) == 1
    err = capsys.readouterr().err
    assert err.startswith("ftctl: error: ") and message in err and err.count("\n") == 1


def test_metrics_summary_uses_the_last_values():
    from ftctl.push import final_metrics

    rows = [{"step": 1, "loss": 3.0, "trained_tokens": 10}, {"step": 2, "loss": 2.0, "trained_tokens": 12},
            {"step": 2, "eval_loss": 1.5}, {"step": 3, "loss": float("nan"), "trained_tokens": 0}]
    summary = final_metrics(rows)
    assert summary == {"steps": 3, "train_loss": 2.0, "eval_loss": 1.5, "eval_perplexity": pytest.approx(4.4817, abs=1e-4),
                       "trained_tokens": 22}
    assert json.dumps(summary)
    with pytest.raises(FtctlError):
        from ftctl.push import resolve_source

        resolve_source("/nonexistent")
