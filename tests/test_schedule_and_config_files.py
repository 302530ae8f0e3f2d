"""Run length and learning-rate schedule, extending a finished run, recipe files by path, and the messages
a user coming from another tool meets: all driven through the `ftctl` command line as a user types it."""

from __future__ import annotations

import json
import shutil
import math
import os
import subprocess
import sys
import time

import pytest
import yaml

from ftctl.cli import main
from ftctl.training.metrics import read_metrics

QUIET = ["train.progress_bar=false", "train.tensorboard=false", "precision=fp32", "train.num_threads=1"]


def ftctl(capsys, *args):
    """Run `ftctl ARGS` in this process: (exit code, stdout, stderr)."""
    code = main(list(args))
    out, err = capsys.readouterr()
    return code, out, err


def write_alpaca(path, n):
    path.write_text("".join(json.dumps({"instruction": f"Add {i} and {i}.", "input": "", "output": str(2 * i)}) + "\n"
                            for i in range(n)))
    return path


def lrs(run_dir):
    return {m["step"]: m["lr"] for m in read_metrics(run_dir) if "lr" in m}


def cosine(step, total, lr, warmup=0, floor_ratio=0.1):
    """The documented cosine schedule, written out independently of ftctl's code: lr at the first step after
    warmup, lr × floor_ratio at the last (0-based ``total - 1``)."""
    if step < warmup:
        return lr * (step + 1) / warmup
    last = total - 1
    progress = (step - warmup) / (last - warmup)
    return lr * floor_ratio + lr * (1 - floor_ratio) * 0.5 * (1 + math.cos(math.pi * progress))


def test_epochs_count_steps_over_the_users_data_and_warmup_ratio_with_a_linear_decay(capsys, tiny_model_dir, tmp_path):
    data = write_alpaca(tmp_path / "mine.jsonl", 12)
    out = tmp_path / "run"
    # The recipe sets train.max_steps; train.epochs on the command line takes its place.
    code, stdout, err = ftctl(capsys, "train", "recipe=tiny_lora", f"model.name_or_path={tiny_model_dir}", f"data.path={data}",
                              f"output_dir={out}", "train.epochs=2", "train.global_batch_size=4", "train.lr=0.01",
                              "train.warmup_ratio=0.3", "train.lr_scheduler=linear", *QUIET)
    assert code == 0, err
    assert "train.epochs=2 over 12 train examples: 6 steps" in stdout  # ceil(2 × 12 / 4)
    metrics = read_metrics(out)
    assert [m["step"] for m in metrics if "loss" in m] == [1, 2, 3, 4, 5, 6]
    assert metrics[-1]["epoch"] == pytest.approx(2.0)
    # warmup = ceil(0.3 × 6) = 2 steps, then a straight line from lr (step 3) to min_lr_ratio × lr at step 6.
    expected = [0.005, 0.01, 0.01, 0.01 - 0.009 * 1 / 3, 0.01 - 0.009 * 2 / 3, 0.001]
    assert [lrs(out)[s] for s in range(1, 7)] == pytest.approx(expected, rel=1e-5)
    saved = yaml.safe_load((out / "config.yaml").read_text())["train"]
    assert saved["epochs"] == 2 and saved["max_steps"] is None and saved["warmup_steps"] == 0


def test_constant_and_cosine_schedules():
    from ftctl.config.compose import compose_config
    from ftctl.training.schedule import learning_rate

    constant = compose_config(["recipe=tiny_lora", "train.lr_scheduler=constant", "train.warmup_steps=2", "train.lr=1e-3"]).train
    assert [learning_rate(s, constant, 10) for s in range(5)] == pytest.approx([5e-4, 1e-3, 1e-3, 1e-3, 1e-3])
    cos = compose_config(["recipe=tiny_lora", "train.warmup_steps=3", "train.lr=1e-3"]).train
    assert cos.lr_scheduler == "cosine"  # the default
    assert [learning_rate(s, cos, 30) for s in range(30)] == pytest.approx([cosine(s, 30, 1e-3, 3) for s in range(30)])
    # The README's floor: the last step trains at min_lr_ratio × lr (tiny_lora, 7 steps: 3e-4, once measured 6.95e-4).
    recipe = compose_config(["recipe=tiny_lora"]).train
    assert (recipe.lr, recipe.min_lr_ratio, recipe.warmup_steps) == (3e-3, 0.1, 3)
    assert learning_rate(6, recipe, 7) == pytest.approx(3e-4) and learning_rate(3, recipe, 7) == pytest.approx(3e-3)
    recipe.lr_scheduler = "linear"
    assert [learning_rate(s, recipe, 7) for s in range(3, 7)] == pytest.approx([3e-3, 2.1e-3, 1.2e-3, 3e-4])
    assert learning_rate(3, recipe, 4) == pytest.approx(3e-3)  # one step after warmup: it takes lr
    default = compose_config(["model.name_or_path=tiny-llama", "train.lr=1e-3"], needs_data=False).train
    assert default.max_steps == 100 and default.epochs is None  # neither set: 100 steps, written into config.yaml


@pytest.mark.parametrize(
    "overrides, message",
    [
        (["train.max_steps=10", "train.epochs=2"], "train.max_steps=10 and train.epochs=2 are both set; keep one"),
        (["train.warmup_steps=3", "train.warmup_ratio=0.1"], "train.warmup_steps=3 and train.warmup_ratio=0.1 are both set"),
        (["train.lr_scheduler=cosin"], "train.lr_scheduler='cosin' is not one of cosine, linear, constant, cosine_restarts, wsd. Did you mean 'cosine'?"),
        (["train.epochs=0"], "train.epochs=0.0 must be > 0"),
        (["train.warmup_ratio=1.5"], "train.warmup_ratio=1.5 must be in [0, 1)"),
    ],
)
def test_schedule_mistakes_are_one_line(capsys, overrides, message):
    code, _, err = ftctl(capsys, "train", "recipe=tiny_lora", *overrides, "--cfg")
    assert code == 2 and err.startswith(f"ftctl: error: {message}") and err.count("\n") == 1


def test_a_finished_run_extends_to_more_steps_from_its_run_dir_alone(capsys, tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    code, _, err = ftctl(capsys, "train", "recipe=tiny_lora", f"model.name_or_path={tiny_model_dir}", f"output_dir={out}",
                         "train.max_steps=4", "train.save_every=2", "train.warmup_steps=0", *QUIET)
    assert code == 0, err
    first = read_metrics(out)
    final = (out / "final" / "adapter_model.safetensors").read_bytes()

    # Nothing new to train: refused, and the result stays.
    code, _, err = ftctl(capsys, "train", f"output_dir={out}", "resume=auto")
    assert code == 1 and "holds a finished run (final/); nothing to resume" in err and "raise train.max_steps above 4" in err
    # A change that alters what is computed: each key with both values.
    code, _, err = ftctl(capsys, "train", f"output_dir={out}", "resume=auto", "train.max_steps=6", "train.lr=1e-3", "method.r=4")
    assert code == 1
    assert "the config differs in method.r (run: 8, now: 4), train.lr (run: 0.003, now: 0.001)" in err
    assert (out / "final" / "adapter_model.safetensors").read_bytes() == final

    # No recipe: the run's own config.yaml, with the new length.
    code, stdout, err = ftctl(capsys, "train", f"output_dir={out}", "resume=auto", "train.max_steps=6")
    assert code == 0, err
    assert f"config: {out / 'config.yaml'}" in stdout and "extending the finished run" in stdout
    assert "resumed from" in stdout and "checkpoints/step-4 at step 4" in stdout
    extended = read_metrics(out)
    assert [m["step"] for m in extended if "loss" in m] == [1, 2, 3, 4, 5, 6]
    assert extended[:len(first)] == first  # the first four steps stay as they were trained
    # The schedule is recomputed for the new total: steps 5 and 6 follow the cosine of a 6-step run.
    assert [lrs(out)[5], lrs(out)[6]] == pytest.approx([cosine(4, 6, 3e-3), cosine(5, 6, 3e-3)], rel=1e-5)
    assert lrs(out)[4] == pytest.approx(cosine(3, 4, 3e-3), rel=1e-5)
    assert (out / "final" / "adapter_model.safetensors").read_bytes() != final
    assert yaml.safe_load((out / "config.yaml").read_text())["train"]["max_steps"] == 6


def test_a_finished_run_without_a_last_checkpoint_is_not_extended(capsys, tiny_model_dir, tmp_path):
    out = tmp_path / "run"
    code, _, err = ftctl(capsys, "train", "recipe=tiny_lora", f"model.name_or_path={tiny_model_dir}", f"output_dir={out}",
                         "train.max_steps=2", *QUIET)
    assert code == 0, err
    shutil.rmtree(out / "checkpoints")  # every run keeps its last step's checkpoint: this one lost it
    code, _, err = ftctl(capsys, "train", f"output_dir={out}", "resume=auto", "train.max_steps=3")
    assert code == 1 and "holds a finished run of 2 steps, but it kept no checkpoint, so it cannot be extended" in err
    assert (out / "final").is_dir()


def test_recipes_show_cp_and_train_with_config(capsys, tiny_model_dir, tmp_path):
    from ftctl.config.compose import compose_config

    code, shown, _ = ftctl(capsys, "recipes", "show", "tiny_lora")
    assert code == 0
    full = yaml.safe_load(shown)
    assert full["method"]["r"] == 8 and full["train"]["max_steps"] == 30 and full["output_dir"].startswith("runs/${now:")
    assert set(full) == {"model", "method", "parallel", "precision", "data", "objective", "train", "output_dir", "seed", "overwrite",
                         "resume"}

    mine = tmp_path / "elsewhere" / "my.yaml"
    mine.parent.mkdir()
    code, stdout, _ = ftctl(capsys, "recipes", "cp", "tiny_lora", str(mine))
    assert code == 0 and f"ftctl train --config {mine}" in stdout
    code, _, err = ftctl(capsys, "recipes", "cp", "tiny_lora", str(mine))
    assert code == 1 and "exists" in err  # never overwrites an edited copy
    edited = yaml.safe_load(mine.read_text())
    edited["model"]["name_or_path"] = str(tiny_model_dir)
    edited["train"].update(max_steps=3, lr=0.005, progress_bar=False, tensorboard=False)
    edited["precision"]["name"] = "fp32"
    mine.write_text(yaml.safe_dump(edited))

    out = tmp_path / "run"
    code, stdout, err = ftctl(capsys, "train", "--config", str(mine), f"output_dir={out}", "method.r=4")
    assert code == 0, err
    assert "done: 3 steps" in stdout
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["train"]["lr"] == 0.005 and saved["method"]["r"] == 4  # the file, and the command line over it
    # A group choice on the command line wins over the section the file sets.
    assert compose_config(["method=full"], config_file=str(mine)).method.name == "full"


@pytest.mark.parametrize(
    "content, message",
    [
        ("train:\n  max_steps: 3\n  lr_rate: 1e-4\n", "{f}:3: unknown config key 'train.lr_rate'. ftctl's name for it: train.lr."),
        ("method:\n  name: lora\ntrain:\n  lr: fast\n", "{f}:4: config key 'train.lr': expected float, got 'fast'"),
        ("train:\n  max_steps: 0\nmodel:\n  name_or_path: tiny-llama\ndata:\n  path: x.jsonl\n", "{f}:2: train.max_steps=0 must be > 0"),
        ("train:\n  lr: [1e-4\n", "{f}:3: not valid YAML"),
        ("- a list\n", "{f}:1: a config file is a mapping of keys"),
    ],
)
def test_config_file_mistakes_name_the_file_and_line(capsys, tmp_path, content, message):
    bad = tmp_path / "bad.yaml"
    bad.write_text(content)
    code, _, err = ftctl(capsys, "train", "--config", str(bad), "--cfg")
    assert code == 2 and err.startswith("ftctl: error: " + message.format(f=bad)) and err.count("\n") == 1


def test_config_file_and_recipe_together_or_missing(capsys, tmp_path):
    code, _, err = ftctl(capsys, "train", "--config", str(tmp_path / "nope.yaml"), "--cfg")
    assert code == 2 and "no such file" in err
    (tmp_path / "a.yaml").write_text("train:\n  lr: 1e-4\n")
    code, _, err = ftctl(capsys, "train", "--config", str(tmp_path / "a.yaml"), "recipe=tiny_lora", "--cfg")
    assert code == 2 and "not both" in err


@pytest.mark.parametrize(
    "override, hint",
    [
        ("train.lr_rate=1e-4", "ftctl's name for it: train.lr."),
        ("learning_rate=1e-4", "ftctl's name for it: train.lr."),
        ("num_epochs=3", "ftctl's name for it: train.epochs."),
        ("train.num_train_epochs=3", "ftctl's name for it: train.epochs."),
        ("epochs=3", "Did you mean 'train.epochs'?"),
        ("per_device_train_batch_size=2", "ftctl's name for it: train.micro_batch_size."),
        ("gradient_accumulation_steps=4", "train.global_batch_size (accumulation = global ÷ (micro × world size))"),
        ("lora_alpha=32", "ftctl's name for it: method.alpha."),
        ("lora_dropout=0.1", "ftctl's name for it: method.dropout."),
        ("sequence_len=1024", "ftctl's name for it: data.max_seq_len."),
        ("data.max_length=1024", "ftctl's name for it: data.max_seq_len."),
        ("lr_scheduler_type=linear", "ftctl's name for it: train.lr_scheduler."),
        ("warmup_ratio=0.1", "Did you mean 'train.warmup_ratio'?"),
    ],
)
def test_other_tools_names_point_to_ftctls_key(capsys, override, hint):
    code, _, err = ftctl(capsys, "train", "recipe=tiny_lora", override, "--cfg")
    assert code == 2 and hint in err and err.count("\n") == 1


@pytest.mark.parametrize("override, answer", [
    ("method=dpo", "set objective=dpo"), ("method=ORPO", "set objective=orpo"), ("method.name=kto", "set objective=kto"),
    ("method=grpo", "RL (PPO, GRPO, RLOO, reward models) is not supported"),
])
def test_preference_methods_point_to_the_objective_not_to_dora(capsys, override, answer):
    code, _, err = ftctl(capsys, "train", "recipe=tiny_lora", override, "--cfg")
    assert code == 2 and answer in err and err.count("\n") == 1
    assert "dora'?" not in err


def run_cli(*args, env=None):
    return subprocess.run([sys.executable, "-m", "ftctl", *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=120)


@pytest.mark.slow
def test_a_hub_model_without_network_is_one_line_at_once(tmp_path):
    # A hub endpoint that cannot resolve (.invalid never does), as on a machine without network.
    env = {"HF_ENDPOINT": "https://hub.ftctl-test.invalid", "HF_HOME": str(tmp_path / "hf"), "HF_HUB_OFFLINE": ""}
    args = ["train", "recipe=tiny_lora", "model.name_or_path=nosuch-org/nosuch-model", f"output_dir={tmp_path / 'run'}"]
    start = time.monotonic()
    unreachable = run_cli(*args, env=env)
    unreachable_s = time.monotonic() - start
    start = time.monotonic()
    startup = run_cli("train", "recipe=tiny_lora", "--cfg")  # the same start-up, without the hub
    startup_s = time.monotonic() - start
    assert startup.returncode == 0
    assert unreachable.returncode == 1
    assert unreachable.stderr.count("\n") == 1 and unreachable.stdout == ""
    assert "model.name_or_path=nosuch-org/nosuch-model: the Hugging Face hub (hub.ftctl-test.invalid) cannot be reached" in unreachable.stderr
    assert unreachable_s < startup_s + 3.0, (unreachable_s, startup_s)  # the probe gives up after 1.5 s; start-up varies
    assert not (tmp_path / "run").exists()
    offline = run_cli(*args, env={**env, "HF_HUB_OFFLINE": "1"})
    assert offline.returncode == 1 and "not in the local Hugging Face cache" in offline.stderr and "HF_HUB_OFFLINE" in offline.stderr


def test_the_hub_probe_itself_takes_under_two_seconds(monkeypatch):
    from ftctl.errors import FtctlError
    from ftctl.models.loading import resolve_model_path

    import huggingface_hub  # noqa: F401  (imported by any real run already; not what is timed)

    monkeypatch.setenv("HF_ENDPOINT", "https://probe.ftctl-test.invalid")
    monkeypatch.delenv("HF_HUB_OFFLINE", raising=False)
    start = time.monotonic()
    with pytest.raises(FtctlError, match="cannot be reached"):
        resolve_model_path("nosuch-org/other-model")
    assert time.monotonic() - start < 2.0


def test_a_run_that_fails_before_its_first_step_never_names_its_run_dir(capsys, tiny_model_dir, tmp_path):
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"instruction": "a", "output": "b"}\n{"instruction": "c", "output": \n')
    out = tmp_path / "run"
    code, stdout, err = ftctl(capsys, "train", "recipe=tiny_lora", f"model.name_or_path={tiny_model_dir}", f"data.path={broken}",
                              f"output_dir={out}", *QUIET)
    assert code != 0 and err.startswith("ftctl: error:")
    assert "run dir" not in stdout and not out.exists()
