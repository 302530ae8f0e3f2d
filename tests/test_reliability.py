"""A long run survives being killed, and a user's mistake costs one message, never a lost checkpoint."""

from __future__ import annotations

import json
import logging
import math
import os
import random
import signal
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from ftctl.errors import FtctlError
from ftctl.training.checkpoint import complete_checkpoints
from ftctl.training.metrics import read_metrics


def losses_by_step(run_dir):
    return {m["step"]: m["loss"] for m in read_metrics(run_dir) if "loss" in m}


# Every subprocess here ends well within this; a hung one fails the test instead of stalling CI.
SUBPROCESS_TIMEOUT = 300
# The kill point is drawn from this seed (override it to reproduce a failure's kill point).
KILL_SEED = int(os.environ.get("FTCTL_TEST_SEED", "20261130"))


def train_cli(tiny_model_dir, out, *extra):
    args = [sys.executable, "-m", "ftctl", "train", "recipe=tiny_lora", f"model.name_or_path={tiny_model_dir}",
            f"output_dir={out}", "train.max_steps=30", "train.save_every=4", "method.dropout=0.1", "precision=fp32",
            "train.progress_bar=false", "train.tensorboard=false", "train.plot=false", "train.num_threads=1", *extra]
    return args


def run_cli(args):
    return subprocess.run(args, capture_output=True, text=True, timeout=SUBPROCESS_TIMEOUT)


def wait_for_step(proc, run_dir, step, timeout=120):
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            raise AssertionError(f"training ended before step {step}: {proc.stderr.read()}")
        if max(losses_by_step(run_dir), default=0) >= step:
            return
        time.sleep(0.02)
    raise AssertionError("timed out waiting for training progress")


@pytest.fixture(scope="module")
def uninterrupted(tiny_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("uninterrupted") / "run"
    done = run_cli(train_cli(tiny_model_dir, out))
    assert done.returncode == 0, done.stderr
    return losses_by_step(out)


@pytest.mark.slow
def test_kill_9_then_resume_matches_an_uninterrupted_run(tiny_model_dir, tmp_path, uninterrupted):
    out = tmp_path / "run"
    kill_after = random.Random(KILL_SEED).randint(6, 24)  # any step after the first checkpoint (step 4)
    proc = subprocess.Popen(train_cli(tiny_model_dir, out), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    wait_for_step(proc, out, kill_after)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    killed_at = max(losses_by_step(out))
    assert killed_at < 30, "the run finished before it could be killed"
    resumed = run_cli(train_cli(tiny_model_dir, out, "resume=auto"))
    assert resumed.returncode == 0, resumed.stderr
    assert "resumed from" in resumed.stdout
    got = losses_by_step(out)
    assert sorted(got) == list(range(1, 31))
    # Same process type and backend: the resumed run must be bit-for-bit the uninterrupted one.
    assert got == uninterrupted, f"killed after step {killed_at} (FTCTL_TEST_SEED={KILL_SEED})"


@pytest.mark.slow
def test_sigterm_saves_a_checkpoint_and_says_how_to_resume(tiny_model_dir, tmp_path, uninterrupted):
    out = tmp_path / "run"
    proc = subprocess.Popen(train_cli(tiny_model_dir, out), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    wait_for_step(proc, out, 6)
    proc.send_signal(signal.SIGTERM)
    _, stderr = proc.communicate(timeout=60)
    assert proc.returncode == 143, stderr
    assert "SIGTERM at step" in stderr and "resume=auto" in stderr and "Traceback" not in stderr
    assert "ERROR stopped: SIGTERM at step" in (out / "train.log").read_text()  # the run dir says why it ended
    # The signal's own checkpoint is the step the run stopped at, whether or not save_every falls there.
    stopped_at = json.loads((complete_checkpoints(out)[-1] / "trainer_state.json").read_text())["step"]
    assert stopped_at == max(losses_by_step(out)) >= 6
    assert f"SIGTERM at step {stopped_at}:" in stderr
    resumed = run_cli(train_cli(tiny_model_dir, out, "resume=auto"))
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {out / 'checkpoints' / f'step-{stopped_at}'}" in resumed.stdout
    assert losses_by_step(out) == uninterrupted


def test_incomplete_checkpoints_are_never_resumed_and_pruning_waits(make_cfg, run_training, tmp_path, monkeypatch):
    result, _ = run_training(make_cfg("train.max_steps=9", "train.save_every=2", "train.keep_last=2"))
    ckpts = complete_checkpoints(result.run_dir)
    assert [p.name for p in ckpts] == ["step-8", "step-9"]  # and one of the last step, to extend the run from
    # A checkpoint cut off while writing: a staging dir, and a step dir without its state file.
    (result.run_dir / "checkpoints" / ".step-10.partial").mkdir()
    broken = result.run_dir / "checkpoints" / "step-12"
    broken.mkdir()
    (broken / "adapter_model.safetensors").write_bytes(b"truncated")
    assert complete_checkpoints(result.run_dir)[-1].name == "step-9"
    # A resume goes on from the last complete one, past the broken ones, to the same result.
    final = (result.final_dir / "adapter_model.safetensors").read_bytes()
    shutil.rmtree(result.final_dir)  # as a run killed while writing its last checkpoint
    shutil.rmtree(result.run_dir / "checkpoints" / "step-9")
    from ftctl.training import runner

    trained, train_step = [], runner.train_step
    monkeypatch.setattr(runner, "train_step", lambda *a, **k: trained.append(1) or train_step(*a, **k))
    resumed, metrics = run_training(make_cfg("train.max_steps=9", "train.save_every=2", "train.keep_last=2", "resume=auto"))
    # Only step 9 trained: the run went on from step-8. Starting over would give the same bytes (it is
    # deterministic), so the steps it trained are what tells a resume from a restart.
    assert len(trained) == 1
    assert [m["step"] for m in metrics if "loss" in m] == list(range(1, 10))  # step 9 appended once, after 1-8
    assert (resumed.final_dir / "adapter_model.safetensors").read_bytes() == final


def test_resume_refuses_a_changed_config_and_allows_cosmetic_changes(make_cfg, run_training, tmp_path):
    from ftctl.training.run_dir import prepare_run_dir

    stopped, _ = run_training(make_cfg("train.max_steps=4", "train.save_every=2"))
    shutil.rmtree(stopped.final_dir)  # as a run stopped after its step-2 checkpoint
    shutil.rmtree(stopped.run_dir / "checkpoints" / "step-4")
    with pytest.raises(FtctlError, match=r"config differs in method.r \(run: 8, now: 4\), train.lr \(run: 0.003, now: 0.001\)"):
        prepare_run_dir(make_cfg("train.max_steps=4", "train.save_every=2", "train.lr=1e-3", "method.r=4", "resume=auto"))
    prepare_run_dir(make_cfg("train.max_steps=4", "train.save_every=2", "train.log_every=2", "resume=auto"))
    with pytest.raises(FtctlError, match="continue it with resume=auto"):
        prepare_run_dir(make_cfg("train.max_steps=4"))


def test_resume_auto_without_a_checkpoint(make_cfg, run_training):
    from ftctl.training.run_dir import prepare_run_dir

    # A run stopped before its first checkpoint starts over cleanly: no metrics of the old attempt stay.
    first, _ = run_training(make_cfg("train.max_steps=2"))
    shutil.rmtree(first.run_dir / "final")
    _, metrics = run_training(make_cfg("train.max_steps=3", "resume=auto"))
    assert [m["step"] for m in metrics if "loss" in m] == [1, 2, 3]
    # A finished run without checkpoints is never overwritten by resume=auto.
    final = (first.run_dir / "final" / "adapter_model.safetensors").read_bytes()
    with pytest.raises(FtctlError, match=r"holds a finished run \(final/\); nothing to resume"):
        prepare_run_dir(make_cfg("train.max_steps=2", "train.lr=1e-3", "resume=auto"))
    assert (first.run_dir / "final" / "adapter_model.safetensors").read_bytes() == final
    # With checkpoints as well: resuming would train the tail again and overwrite the result.
    overwritten, _ = run_training(make_cfg("train.max_steps=4", "train.save_every=2", "overwrite=true"))
    with pytest.raises(FtctlError, match=r"holds a finished run"):
        prepare_run_dir(make_cfg("train.max_steps=4", "train.save_every=2", "resume=auto"))


def test_resume_refuses_another_backend_or_world_size_before_starting(make_cfg, run_training, tmp_path):
    from ftctl.training.checkpoint import STATE_FILE
    from ftctl.training.run_dir import prepare_run_dir

    first, _ = run_training(make_cfg("train.max_steps=2", "train.save_every=1"))
    ckpt = first.run_dir / "checkpoints" / "step-1"
    elsewhere = tmp_path / "elsewhere"
    with pytest.raises(FtctlError, match=r"step-1 was written by parallel=single and this run has parallel=fsdp"):
        prepare_run_dir(make_cfg("train.max_steps=2", "parallel=fsdp", f"output_dir={elsewhere}", f"resume={ckpt}"))
    with pytest.raises(FtctlError, match=r"written by 1 processes and this run has 2"):
        prepare_run_dir(make_cfg("train.max_steps=2", "parallel=ddp", "parallel.nproc_per_node=2", f"output_dir={elsewhere}",
                                 f"resume={ckpt}"))
    # Under a launcher (torchrun sets WORLD_SIZE) the launcher's world size is the run's.
    from ftctl.training.resume import check_resumable_by

    with pytest.MonkeyPatch.context() as env:
        env.setenv("RANK", "0"), env.setenv("WORLD_SIZE", "2")
        with pytest.raises(FtctlError, match=r"written by 1 processes and this run has 2"):
            check_resumable_by(ckpt, make_cfg("parallel=ddp", f"output_dir={elsewhere}"))
        env.setenv("WORLD_SIZE", "1")
        check_resumable_by(ckpt, make_cfg("parallel=ddp", "parallel.nproc_per_node=2", f"output_dir={elsewhere}"))
    state = json.loads((ckpt / STATE_FILE).read_text())
    del state["parallel"]  # as checkpoints from before the backend was recorded: read from the layout
    (ckpt / STATE_FILE).write_text(json.dumps(state))
    with pytest.raises(FtctlError, match=r"written by parallel=single or ddp and this run has parallel=zero2"):
        prepare_run_dir(make_cfg("train.max_steps=2", "parallel=zero2", f"output_dir={elsewhere}", f"resume={ckpt}"))
    assert not elsewhere.exists()


def test_overwrite_starts_over(make_cfg, run_training):
    first, _ = run_training(make_cfg("train.max_steps=4", "train.save_every=2"))
    second, metrics = run_training(make_cfg("train.max_steps=2", "overwrite=true"))
    assert not (second.run_dir / "checkpoints").exists()
    assert [m["step"] for m in metrics] == [1, 2]


def test_nan_stops_with_the_step_and_keeps_the_last_good_state(make_cfg, run_training, monkeypatch, caplog):
    import ftctl.training.runner as runner

    real_loss, calls = runner.token_loss_sum, {"n": 0}

    def poisoned(module, batch, device):
        calls["n"] += 1
        loss = real_loss(module, batch, device)
        return loss * float("nan") if calls["n"] > 2 * 4 else loss  # 2 micro-batches per step: NaN from step 5

    monkeypatch.setattr(runner, "token_loss_sum", poisoned)
    with pytest.raises(FtctlError, match=r"step 5: non-finite training.*saved in .*step-4") as info:
        run_training(make_cfg("train.max_steps=8"))
    ckpt = Path(str(info.value).split("saved in ")[1].split(". ")[0])
    from safetensors.torch import load_file

    weights = load_file(ckpt / "adapter_model.safetensors")
    assert all(torch.isfinite(w).all() for w in weights.values())

    calls["n"] = 0
    monkeypatch.setattr(runner, "token_loss_sum",
                        lambda m, b, d: (lambda l: l * float("nan") if calls.__setitem__("n", calls["n"] + 1) or calls["n"] in (5, 6) else l)(real_loss(m, b, d)))
    caplog.set_level(logging.WARNING, logger="ftctl")
    result, metrics = run_training(make_cfg("train.max_steps=5", "train.max_nonfinite_steps=1", "overwrite=true"))
    losses = {m["step"]: m["loss"] for m in metrics if "loss" in m}
    assert sorted(losses) == [1, 2, 3, 4, 5] and not math.isfinite(losses[3])  # step 3 was the poisoned one...
    assert all(math.isfinite(losses[s]) for s in (1, 2, 4, 5))
    # ...and was skipped, not applied: the log says so, and the weights stayed finite.
    assert "step 3: non-finite loss or gradients; update skipped (1 of 1 allowed)" in caplog.text
    assert all(torch.isfinite(p).all() for p in result.model.parameters())


def test_optimizer_state_is_loaded_without_unpickling_code(make_cfg, run_training, tmp_path):
    result, _ = run_training(make_cfg("train.max_steps=4", "train.save_every=2"))
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({"optimizer": Exploit()}, result.run_dir / "checkpoints" / "step-2" / "optimizer.rank0.pt")
    from ftctl.training.run_dir import prepare_run_dir
    from ftctl.training.runner import train

    cfg = make_cfg("train.max_steps=4", "train.save_every=2", f"output_dir={tmp_path / 'resumed'}", "resume=checkpoints")
    cfg.resume = str(result.run_dir / "checkpoints" / "step-2")
    with pytest.raises(Exception) as info:
        train(cfg, prepare_run_dir(cfg))
    assert "weights_only" in str(info.value) or "Unsupported global" in str(info.value)
    assert not marker.exists()


def test_configs_cannot_instantiate_objects():
    from ftctl.config.compose import compose_config
    from ftctl.errors import ConfigError

    for override in ("+_target_=os.system", "_target_=os.system", "model._target_=os.system"):
        with pytest.raises(ConfigError):
            compose_config(["recipe=tiny_lora", override])


def test_remote_code_is_not_run_unless_allowed(tmp_path, tiny_model_dir, monkeypatch):
    from ftctl.config.schema import ModelConfig
    from ftctl.models.loading import load_causal_lm

    model_dir = tmp_path / "remote"
    shutil.copytree(tiny_model_dir, model_dir)
    marker = tmp_path / "ran"
    (model_dir / "evil.py").write_text(f"open({str(marker)!r}, 'w').write('x')\nfrom transformers import LlamaConfig as EvilConfig\n")
    config = json.loads((model_dir / "config.json").read_text())
    config["auto_map"] = {"AutoConfig": "evil.EvilConfig"}
    (model_dir / "config.json").write_text(json.dumps(config))
    model = load_causal_lm(ModelConfig(name_or_path=str(model_dir)), str(model_dir), dtype=torch.float32)
    assert type(model).__module__.startswith("transformers.")  # the built-in class, not the repo's code
    assert not marker.exists()
    # Allowed, the repo's own code runs. Loading it registers evil.py's class (here transformers' own
    # LlamaConfig) for auto-loading; monkeypatch undoes that so later saves in this process stay plain.
    from transformers import LlamaConfig

    monkeypatch.setattr(LlamaConfig, "_auto_class", getattr(LlamaConfig, "_auto_class", None))
    allowed = load_causal_lm(ModelConfig(name_or_path=str(model_dir), trust_remote_code=True), str(model_dir), dtype=torch.float32)
    assert marker.exists() and type(allowed).__name__ == "LlamaForCausalLM"
