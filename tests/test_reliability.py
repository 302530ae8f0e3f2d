"""A long run survives being killed, and a user's mistake costs one message, never a lost checkpoint."""

from __future__ import annotations

import hashlib
import json
import logging
import math
import os
import random
import re
import signal
import shutil
import socket
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


def checksums(root: Path) -> dict:
    """Every file under ``root`` (relative path -> sha256): what a test compares before and after a fault."""
    root = Path(root)
    return {str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(root.rglob("*")) if p.is_file()}


def test_resume_auto_without_a_checkpoint_moves_the_attempt_aside(make_cfg, run_training, caplog):
    from ftctl.training.run_dir import prepare_run_dir

    # A run stopped before its first checkpoint: resume=auto starts over, keeping the earlier attempt's files.
    first, _ = run_training(make_cfg("train.max_steps=2"))
    shutil.rmtree(first.run_dir / "final")
    shutil.rmtree(first.run_dir / "checkpoints")
    (first.run_dir / "notes.txt").write_text("mine")  # a user's file in the run dir
    before = checksums(first.run_dir)
    caplog.set_level(logging.INFO, logger="ftctl")
    _, metrics = run_training(make_cfg("train.max_steps=3", "resume=auto"))
    assert [m["step"] for m in metrics if "loss" in m] == [1, 2, 3]
    assert "holds no complete checkpoint to continue from; moved the earlier attempt's files (metrics.jsonl, config.yaml) to attempt-1/" in caplog.text
    after = checksums(first.run_dir)
    assert {name: after[f"attempt-1/{name}"] for name in ("metrics.jsonl", "config.yaml")} == \
           {name: before[name] for name in ("metrics.jsonl", "config.yaml")}
    assert after["notes.txt"] == before["notes.txt"]
    # A finished run whose last checkpoint is gone is never overwritten by resume=auto.
    shutil.rmtree(first.run_dir / "checkpoints")
    final = checksums(first.run_dir / "final")
    with pytest.raises(FtctlError, match=r"holds a finished run \(final/\); nothing to resume"):
        prepare_run_dir(make_cfg("train.max_steps=3", "train.lr=1e-3", "resume=auto"))
    with pytest.raises(FtctlError, match=r"holds a finished run of 3 steps, but it kept no checkpoint"):
        prepare_run_dir(make_cfg("train.max_steps=4", "resume=auto"))
    assert checksums(first.run_dir / "final") == final


def test_every_run_checkpoints_its_last_step_and_keeps_the_newest_two(make_cfg, run_training, tmp_path):
    from ftctl.config.schema import TrainConfig

    assert (TrainConfig().save_every, TrainConfig().keep_last) == (200, 2)
    result, _ = run_training(make_cfg("train.max_steps=5", "train.save_every=2"))
    assert [p.name for p in complete_checkpoints(result.run_dir)] == ["step-4", "step-5"]  # step 2 pruned, 5 the last
    resumed, metrics = run_training(make_cfg("train.max_steps=6", "train.save_every=2", "resume=auto"))
    assert [m["step"] for m in metrics if "loss" in m] == [1, 2, 3, 4, 5, 6]  # extended from the last step's checkpoint
    only_last, _ = run_training(make_cfg("train.max_steps=2", "train.save_every=0", f"output_dir={tmp_path / 'only_last'}"))
    assert [p.name for p in complete_checkpoints(only_last.run_dir)] == ["step-2"]


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


def test_overwrite_removes_only_what_ftctl_wrote(make_cfg, run_training, caplog):
    first, _ = run_training(make_cfg("train.max_steps=4", "train.save_every=2"))
    (first.run_dir / "notes.txt").write_text("mine")
    (first.run_dir / "data").mkdir()
    (first.run_dir / "data" / "x.jsonl").write_text("{}\n")
    mine = {k: v for k, v in checksums(first.run_dir).items() if k.startswith(("notes", "data/"))}
    caplog.set_level(logging.INFO, logger="ftctl")
    second, metrics = run_training(make_cfg("train.max_steps=2", "overwrite=true"))
    assert "overwrite=true: removed checkpoints/, final/, metrics.jsonl, config.yaml from" in caplog.text
    assert "left what ftctl did not write: data, notes.txt" in caplog.text
    assert [p.name for p in complete_checkpoints(second.run_dir)] == ["step-2"]
    assert [m["step"] for m in metrics] == [1, 2]
    assert {k: v for k, v in checksums(second.run_dir).items() if k.startswith(("notes", "data/"))} == mine


def test_directories_that_are_not_runs_are_refused_and_left_alone(make_cfg, tmp_path, monkeypatch, capsys):
    from ftctl.cli import main
    from ftctl.training.run_dir import MARKER_FILE, prepare_run_dir

    mine = tmp_path / "project"
    (mine / "checkpoints" / "step-3").mkdir(parents=True)  # even names a run would write: no marker, not a run
    (mine / "checkpoints" / "step-3" / "weights.bin").write_bytes(b"\0" * 100)
    (mine / "notes.txt").write_text("mine")
    (mine / "metrics.jsonl").write_text('{"step": 1}\n')
    before = checksums(mine)
    for flag, expected in (("resume=auto", r"resume=auto: output_dir .*project is not an ftctl run \(no \.ftctl-run marker\) "
                                           r"and holds checkpoints, metrics.jsonl, notes.txt, so there is nothing to resume"),
                           ("overwrite=true", r"overwrite=true: .* is not an ftctl run .*; ftctl deletes only what its runs wrote"),
                           ("seed=1", r"output_dir .* is not an ftctl run .*; choose a new or empty output_dir")):
        with pytest.raises(FtctlError, match=expected):
            prepare_run_dir(make_cfg(f"output_dir={mine}", flag))
    assert checksums(mine) == before and not (mine / MARKER_FILE).exists()
    (mine / "config.yaml").write_text("seed: 1\n")  # what a run of an ftctl before the marker looks like
    with pytest.raises(FtctlError, match=rf"\(if an earlier ftctl wrote it, mark it as a run: touch {re.escape(str(mine / MARKER_FILE))}\)"):
        prepare_run_dir(make_cfg(f"output_dir={mine}", "resume=auto"))
    # The root, the home directory, the current directory and what lies above them: refused before anything else.
    work = tmp_path / "work" / "repo"
    work.mkdir(parents=True)
    monkeypatch.chdir(work)
    for where, what in (("/", "the file system root"), (str(Path.home()), "the home directory"), (str(work), "the current directory"),
                        (str(work.parent), "a directory above the current directory")):
        flag = "resume=auto" if what.startswith(("the file", "the current")) else "overwrite=true"
        assert main(["train", "recipe=tiny_lora", f"output_dir={where}", flag, "precision=fp32"]) == 1
        err = capsys.readouterr().err.strip()
        assert err.startswith(f"ftctl: error: output_dir {where} is {what}") and len(err.splitlines()) == 1, err
    assert not (work / MARKER_FILE).exists() and not (Path.home() / MARKER_FILE).exists()
    # resume=auto where no run is yet: a preemptible job's first start.
    cfg = make_cfg(f"output_dir={tmp_path / 'new'}", "resume=auto")
    assert (prepare_run_dir(cfg) / MARKER_FILE).is_file()


def test_nan_stops_with_the_step_and_keeps_the_last_good_state(make_cfg, run_training, monkeypatch, caplog):
    import ftctl.objectives.base as sft

    real_loss, calls = sft.token_loss_sum, {"n": 0}

    def poisoned(module, batch, device):
        calls["n"] += 1
        loss = real_loss(module, batch, device)
        return loss * float("nan") if calls["n"] > 2 * 4 else loss  # 2 micro-batches per step: NaN from step 5

    monkeypatch.setattr(sft, "token_loss_sum", poisoned)
    with pytest.raises(FtctlError, match=r"step 5: non-finite training.*saved in .*step-4") as info:
        run_training(make_cfg("train.max_steps=8"))
    ckpt = Path(str(info.value).split("saved in ")[1].split(". ")[0])
    from safetensors.torch import load_file

    weights = load_file(ckpt / "adapter_model.safetensors")
    assert all(torch.isfinite(w).all() for w in weights.values())

    calls["n"] = 0
    monkeypatch.setattr(sft, "token_loss_sum",
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
    from ftctl.training.checkpoint import STATE_FILE

    result, _ = run_training(make_cfg("train.max_steps=4", "train.save_every=2"))
    marker = tmp_path / "pwned"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    ckpt = result.run_dir / "checkpoints" / "step-2"
    torch.save({"optimizer": Exploit()}, ckpt / "optimizer.rank0.pt")
    state = json.loads((ckpt / STATE_FILE).read_text())  # a careful attacker lists the file's new size too
    state["files"]["optimizer.rank0.pt"] = (ckpt / "optimizer.rank0.pt").stat().st_size
    (ckpt / STATE_FILE).write_text(json.dumps(state))
    from ftctl.training.run_dir import prepare_run_dir
    from ftctl.training.runner import train

    cfg = make_cfg("train.max_steps=4", "train.save_every=2", f"output_dir={tmp_path / 'resumed'}", "resume=checkpoints")
    cfg.resume = str(ckpt)
    with pytest.raises(FtctlError) as info:
        train(cfg, prepare_run_dir(cfg))
    assert str(info.value) == (f"{ckpt / 'optimizer.rank0.pt'}: refused to unpickle: it would call posix.system (a pickle can run "
                               "code; ftctl loads tensors and plain data only); if you trust the file, convert it to safetensors")
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


# ----------------------------------------------------------------------------------------------
# one writer, no orphans


def _two_rank_run(tiny_model_dir, out, scratch, *extra):
    """`ftctl train` of a 2-rank DDP run that trains until stopped, with its own temporary dir."""
    scratch.mkdir(exist_ok=True)
    env = dict(os.environ, TMPDIR=str(scratch), OMP_NUM_THREADS="1")
    return subprocess.Popen(train_cli(tiny_model_dir, out, "parallel=ddp", "parallel.nproc_per_node=2", "train.max_steps=100000",
                                      "train.save_every=0", *extra), env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _workers_of(launcher_pid: int) -> dict:
    """The launcher's worker processes by rank, read from their environment."""
    found = {}
    for child in Path(f"/proc/{launcher_pid}/task/{launcher_pid}/children").read_text().split():
        env = dict(item.split("=", 1) for item in Path(f"/proc/{child}/environ").read_text().split("\0") if "=" in item)
        found[int(env["RANK"])] = int(child)
    return found


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] if Path(f"/proc/{pid}/stat").exists() else "X"
    return state not in ("Z", "X")  # a zombie has ended; only its parent has not collected it


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads the process tree from Linux's /proc")
def test_kill_9_of_ftctl_stops_its_workers_and_its_lock_passes_on(tiny_model_dir, tmp_path, capsys):
    from ftctl.cli import main
    from ftctl.training.run_dir import prepare_run_dir

    out, scratch = tmp_path / "run", tmp_path / "tmp"
    parent = _two_rank_run(tiny_model_dir, out, scratch)
    wait_for_step(parent, out, 2, timeout=240)
    launcher = int(Path(f"/proc/{parent.pid}/task/{parent.pid}/children").read_text().split()[0])
    workers = _workers_of(launcher)
    assert sorted(workers) == [0, 1]
    # One writer: a second run of the same dir is refused in one line naming the live holder, and changes nothing.
    before = checksums(out)
    assert main(train_cli(tiny_model_dir, out, "resume=auto")[3:]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith(f"ftctl: error: output_dir {out} is in use by another ftctl run: PID {parent.pid} on {socket.gethostname()}")
    assert len(err.splitlines()) == 1
    assert {k: v for k, v in checksums(out).items() if k != "metrics.jsonl"} == {k: v for k, v in before.items() if k != "metrics.jsonl"}
    parent.kill()
    parent.wait()
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in (launcher, *workers.values())) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not [pid for pid in (launcher, *workers.values()) if _alive(pid)], "the launcher or a worker outlived ftctl"
    # The lock died with its holder: the next run takes it over, with a notice, and moves the stopped attempt aside.
    from ftctl.config.compose import compose_config

    cfg = compose_config(train_cli(tiny_model_dir, out, "resume=auto", "train.save_every=0")[4:])
    prepare_run_dir(cfg)
    said = capsys.readouterr().out  # main() above sent the ftctl log to stdout
    assert f"took over the lock of PID {parent.pid} on {socket.gethostname()}" in said
    assert "moved the earlier attempt's files" in said
    from ftctl.training.run_dir import finish_run_dir

    finish_run_dir(out)


def test_the_rank_that_died_comes_before_the_ranks_it_took_down(tmp_path, monkeypatch, capsys):
    from ftctl.launch import ERROR_DIR_ENV, report_worker_error, worker_failure

    monkeypatch.setenv(ERROR_DIR_ENV, str(tmp_path))
    try:
        raise RuntimeError("[pair.cc:537] Read error: Connection reset by peer. This is typically caused by ...")
    except RuntimeError as exc:
        report_worker_error(2, exc)
    (tmp_path / "launcher.json").write_text(json.dumps([{"rank": 0, "exitcode": -15, "time": 1}, {"rank": 1, "exitcode": -9, "time": 2},
                                                         {"rank": 2, "exitcode": 1, "time": 2}]))
    assert str(worker_failure(tmp_path, 1)).splitlines() == [
        "rank 1 was killed by SIGKILL (signal 9: the out-of-memory killer, or kill -9); the run stopped",
        "rank 2 stopped after it: RuntimeError: Read error: Connection reset by peer",
        "rank 0 stopped after it: the launcher ended it (SIGTERM)",
    ]
    assert capsys.readouterr().err == ""  # the survivors' tracebacks are not the story
    (tmp_path / "launcher.json").unlink()  # a rank that failed alone, with a bug: its traceback is shown
    assert str(worker_failure(tmp_path, 1)) == "rank 2 failed (traceback above): RuntimeError: Read error: Connection reset by peer"
    assert "Traceback (most recent call last)" in capsys.readouterr().err


@pytest.mark.slow
@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="reads the process tree from Linux's /proc")
def test_a_killed_worker_is_named_first_and_no_temporary_dir_stays(tiny_model_dir, tmp_path):
    out, scratch = tmp_path / "run", tmp_path / "tmp"
    parent = _two_rank_run(tiny_model_dir, out, scratch)
    wait_for_step(parent, out, 2, timeout=240)
    launcher = int(Path(f"/proc/{parent.pid}/task/{parent.pid}/children").read_text().split()[0])
    os.kill(_workers_of(launcher)[1], signal.SIGKILL)
    _, err = parent.communicate(timeout=120)
    assert parent.returncode == 1
    lines = err.strip().splitlines()
    assert lines[0] == "ftctl: error: rank 1 was killed by SIGKILL (signal 9: the out-of-memory killer, or kill -9); the run stopped", err
    assert all(line.startswith("rank 0 stopped after it: ") for line in lines[1:]) and "Traceback" not in err, err  # gloo's error, or SIGTERM
    assert "ERROR stopped: rank 1 was killed by SIGKILL" in (out / "train.log").read_text()
    assert list(scratch.iterdir()) == []  # torch's launcher logs and ftctl's error reports went with the launch


# ----------------------------------------------------------------------------------------------
# damaged checkpoints


def _cut(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _scramble_header(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[8:40] = b"#" * 32  # same size: only the header check can tell
    path.write_bytes(bytes(data))


DAMAGE = {
    "missing_file": (lambda c: (c / "optimizer.rank0.pt").unlink(), "optimizer.rank0.pt is missing"),
    "cut_short": (lambda c: _cut(c / "rng.rank0.pt"), r"rng.rank0.pt is \d+ bytes, written as \d+"),
    "safetensors_header": (lambda c: _scramble_header(c / "adapter_model.safetensors"), "adapter_model.safetensors has a damaged header"),
    "state_json": (lambda c: (c / "trainer_state.json").write_text('{"step": 6, "wor'), r"trainer_state.json does not parse \(Unterminated string.*?\)"),
}


@pytest.fixture(scope="module")
def six_steps(tiny_model_dir, tmp_path_factory):
    """A 6-step run with checkpoints at 2, 4 and 6: its losses, final adapter and run dir."""
    from ftctl.config.compose import compose_config
    from ftctl.training.run_dir import finish_run_dir, prepare_run_dir
    from ftctl.training.runner import train

    out = tmp_path_factory.mktemp("six") / "run"
    cfg = compose_config(train_cli(tiny_model_dir, out, "train.max_steps=6", "train.save_every=2", "train.keep_last=0")[4:])
    result = train(cfg, prepare_run_dir(cfg))
    finish_run_dir(out)
    return losses_by_step(out), (result.final_dir / "adapter_model.safetensors").read_bytes(), out


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_a_damaged_newest_checkpoint_falls_back_to_the_one_before(damage, six_steps, tiny_model_dir, tmp_path, capsys):
    from ftctl.cli import main

    losses, final, original = six_steps
    out = tmp_path / "run"
    shutil.copytree(original, out)
    shutil.rmtree(out / "final")  # as if killed right after the step-6 checkpoint, which then got damaged
    harm, problem = DAMAGE[damage]
    harm(out / "checkpoints" / "step-6")
    with open(out / "metrics.jsonl", "a") as f:
        f.write('{"step": 7, "loss": 1.2')  # and the kill cut the metrics file mid-line
    earlier = checksums(out / "checkpoints" / "step-4")
    # resume=PATH to it refuses in one line, and writes nothing anywhere.
    assert main(train_cli(tiny_model_dir, tmp_path / "other", "train.max_steps=6", f"resume={out / 'checkpoints' / 'step-6'}")[3:]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and re.search(rf"resume=.*step-6: not a usable ftctl checkpoint: {problem}", err[0]), err
    assert not (tmp_path / "other").exists()
    # resume=auto takes step 4, says why in one line, and ends where the uninterrupted run ended.
    assert main(train_cli(tiny_model_dir, out, "train.max_steps=6", "train.save_every=2", "train.keep_last=0", "resume=auto")[3:]) == 0
    said = capsys.readouterr().out
    assert re.search(rf"resume=auto: .*step-6 is damaged \({problem}\); set aside as step-6.damaged, continuing from step-4", said), said
    assert "metrics.jsonl: dropped its last line (line 7), cut off when the run stopped" in said
    assert losses_by_step(out) == losses
    assert (out / "final" / "adapter_model.safetensors").read_bytes() == final
    assert checksums(out / "checkpoints" / "step-4") == earlier
    assert (out / "checkpoints" / "step-6.damaged").is_dir()


# ----------------------------------------------------------------------------------------------
# divergence


def test_a_run_that_collapsed_at_lr_1e6_stops_and_keeps_its_last_good_checkpoint(make_cfg, run_training, caplog):
    from ftctl.training.divergence import TrainingDiverged

    # At lr=1e6 (warmup 3 steps) the tiny model's loss sits at ln(512) = 6.2383 with gradient norm 0 from step 3 on:
    # the weights step 2 left are the first bad ones.
    cfg = make_cfg("train.max_steps=12", "train.lr=1e6", "train.save_every=1", "train.keep_last=2")
    with pytest.raises(TrainingDiverged) as info:
        run_training(cfg)
    message = str(info.value)
    assert re.match(r"step 5: the run diverged: the loss has sat at 6\.2383 = ln\(vocabulary size\), the uniform prediction, "
                    r"with gradient norm 0 since step 3: .*the learning rate \(train\.lr=1e\+06\) is likely too high", message), message
    run_dir = Path(cfg.output_dir)
    assert f"the last checkpoint from before it is {run_dir / 'checkpoints' / 'step-1'}" in message
    assert "train.stop_on_divergence=false" in message and "\n" not in message
    # keep_last=2 would have pruned step 1 for steps 3 and 4: the good one is kept, and the diverged state is not saved.
    assert [p.name for p in complete_checkpoints(run_dir)] == ["step-1", "step-3", "step-4"]
    assert not (run_dir / "final").exists() and max(losses_by_step(run_dir)) == 5
    # With the flag the run goes on, after one warning.
    caplog.set_level(logging.WARNING, logger="ftctl")
    result, metrics = run_training(make_cfg("train.max_steps=6", "train.lr=1e6", "train.stop_on_divergence=false",
                                            "overwrite=true"))
    assert result.steps == 6 and caplog.text.count("the run diverged") == 1


def test_a_climbing_loss_stops_after_its_window():
    from types import SimpleNamespace

    from ftctl.training.divergence import DivergenceGuard, TrainingDiverged

    guard = DivergenceGuard(SimpleNamespace(stop_on_divergence=True, divergence_window=4, lr=1e-2), None, Path("/nonexistent"))
    for step, loss in enumerate([2.0, 2.1, 1.9, 2.15, 1.5, 2.3, 2.4, 2.5], start=1):  # start 2.0; above 2.2 from step 6
        guard.check(step, loss, 1.0)
    with pytest.raises(TrainingDiverged, match=r"step 9: the run diverged: the loss has stayed above its start \(2\.0000\) "
                                               r"for 4 steps since step 6, now 2\.6000.*train\.lr=0\.01"):
        guard.check(9, 2.6, 1.0)


def test_nonfinite_advice_fits_the_precision():
    from ftctl.training.interrupts import NonFiniteTraining

    fp32, bf16, fp16 = (str(NonFiniteTraining(3, float("nan"), float("nan"), None, p, 3e-3)) for p in ("fp32", "bf16", "fp16"))
    assert "precision=fp32" not in fp32 and "fp32 already" in fp32 and "train.lr (now 0.003)" in fp32
    assert "precision=fp32" in bf16 and "bf16" in fp16 and "max_nonfinite_steps" in fp32
