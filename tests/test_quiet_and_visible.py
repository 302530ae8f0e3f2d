"""Quiet, consistent, visible: no library notice a user cannot act on, progress bars on every long command
(on stderr, only on a terminal unless forced, off with --no-progress), one FTCTL_HOME rule, a train --help
that teaches the keys."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ftctl.cli import main

ROOT = Path(__file__).resolve().parent.parent

# bitsandbytes looks for the optional `kernels` package only on CPUs with avx512_bf16; pretend this is one.
_IMPORT_BNB_ON_AVX512_BF16 = """
import importlib, sys
{quiet}
import bitsandbytes, bitsandbytes.functional as functional
functional.has_avx512bf16 = lambda: True
importlib.reload(bitsandbytes.backends.cpu.ops)
"""


@pytest.mark.slow
def test_the_missing_kernels_package_notice_of_bitsandbytes_is_silenced():
    pytest.importorskip("bitsandbytes")
    if importlib_has("kernels"):
        pytest.skip("the kernels package is installed here, so bitsandbytes has nothing to say")

    def stderr_of(quiet: str) -> str:
        code = _IMPORT_BNB_ON_AVX512_BF16.format(quiet=quiet)
        return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300,
                              env=dict(os.environ, PYTHONPATH=str(ROOT))).stderr

    assert "kernels-community" in stderr_of("")  # without ftctl's filter the notice appears: the check can fail
    assert "kernels-community" not in stderr_of("from ftctl.cli import quiet_libraries; quiet_libraries(False)")


def importlib_has(module: str) -> bool:
    import importlib.util

    return importlib.util.find_spec(module) is not None


def test_train_help_lists_groups_choices_main_keys_and_points_to_config_docs(capsys):
    with pytest.raises(SystemExit) as stop:
        main(["train", "--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    from ftctl.config.compose import GROUPS, group_options

    for group in GROUPS:
        line = next(line for line in out.splitlines() if line.strip().startswith(group + " "))
        assert all(choice in line for choice in group_options(group)), line
    for key in ("model.name_or_path", "data.path", "train.max_steps", "train.lr", "train.report_to"):
        assert f"  {key} " in out
    assert "ftctl config-docs" in out


def test_make_and_an_activated_venv_share_one_ftctl_home(tmp_path):
    """`make demo` runs ftctl with the Makefile's environment; with FTCTL_HOME unset, that must give the
    cache a plain `ftctl` in the activated venv uses, or the demo's converted model is converted again."""
    if shutil.which("make") is None:
        pytest.skip("no make here")
    env = {k: v for k, v in os.environ.items() if k != "FTCTL_HOME"}
    env.update(PYTHONPATH=str(ROOT), HOME=str(tmp_path))
    show = "from ftctl.paths import ftctl_home; print(ftctl_home())"
    plain = subprocess.run([sys.executable, "-c", show], env=env, capture_output=True, text=True, check=True).stdout
    rule = f"print-home: ; @\"{sys.executable}\" -c \"{show}\""
    under_make = subprocess.run(["make", "-s", "-C", str(ROOT), f"--eval={rule}", "print-home"],
                                env=env, capture_output=True, text=True, check=True).stdout
    assert under_make == plain == f"{tmp_path / '.cache' / 'ftctl'}\n"


def _alpaca(path: Path, n: int = 3) -> Path:
    rows = [{"instruction": f"Say {w}.", "output": w} for w in ("yes", "no", "maybe", "later")[:n]]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.mark.slow
def test_long_commands_show_progress_on_stderr_when_asked_and_never_off_a_terminal(
        make_cfg, run_training, tmp_path, monkeypatch, capsys):
    result, _ = run_training(make_cfg("train.max_steps=1", "precision=fp32"))
    data = _alpaca(tmp_path / "held_out.jsonl")
    evaluate = ["eval", f"model={result.run_dir}", f"data.path={data}", "max_new_tokens=2"]

    monkeypatch.delenv("FTCTL_PROGRESS", raising=False)  # pytest's stderr is no terminal: no bars
    assert main([*evaluate, f"output={tmp_path / 'e0'}"]) == 0
    assert "eval:" not in capsys.readouterr().err

    monkeypatch.setenv("FTCTL_PROGRESS", "1")
    assert main([*evaluate, f"output={tmp_path / 'e1'}"]) == 0
    captured = capsys.readouterr()
    assert "eval: 100%" in captured.err and "3/3" in captured.err and "eval: 100%" not in captured.out
    assert "merge adapter: 100%" in captured.err  # the adapter is merged into its base on the way

    assert main([*evaluate, f"output={tmp_path / 'e2'}", "--no-progress"]) == 0
    assert "eval:" not in capsys.readouterr().err
    monkeypatch.setenv("FTCTL_PROGRESS", "1")  # --no-progress set it to 0 for this process

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text('{"prompt": "hi"}\n{"prompt": "bye"}\n')
    assert main(["generate", f"model={result.run_dir}", f"input={prompts}", f"output={tmp_path / 'out.jsonl'}", "max_new_tokens=2"]) == 0
    assert "generate: 100%" in capsys.readouterr().err

    assert main(["merge", f"adapter={result.final_dir}", f"output={tmp_path / 'merged'}"]) == 0
    err = capsys.readouterr().err
    assert "merge adapter: 100%" in err and "write merged: 100%" in err

    pytest.importorskip("gguf")
    assert main(["export", f"model={tmp_path / 'merged'}", "format=gguf", f"output={tmp_path / 'm.gguf'}"]) == 0
    assert "write m.gguf: 100%" in capsys.readouterr().err

    # Converting the default model from its GGUF file (here the tiny one just exported stands in for it).
    monkeypatch.setenv("FTCTL_SMOLLM2_GGUF", str(tmp_path / "m.gguf"))
    monkeypatch.setenv("FTCTL_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("FTCTL_PROGRESS")
    assert main(["models", "--prepare", "smollm2-135m-instruct"]) == 0
    err = capsys.readouterr().err
    assert "convert" not in err and "de-quantizing" not in err  # transformers' own bar follows the rule too
    monkeypatch.setenv("FTCTL_PROGRESS", "1")
    assert main(["models", "--rebuild", "smollm2-135m-instruct"]) == 0
    err = capsys.readouterr().err
    assert "convert: 100%" in err and "dequantize:" in err
