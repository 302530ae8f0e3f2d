"""Every mistake a user can make on the command line: one line naming the file and line or the key,
a non-zero exit, no traceback, and nothing half-written."""

from __future__ import annotations

import json

import pytest

from ftctl.cli import main

GOOD = {"instruction": "Say hi", "input": "", "output": "hi"}


def write(path, text):
    path.write_text(text)
    return path


CASES = {
    "malformed_json_line": (lambda d: [f"data.path={write(d / 'x.jsonl', json.dumps(GOOD) + chr(10) + '{oops' + chr(10))}"],
                            r"x\.jsonl:2: malformed JSON line"),
    "missing_field": (lambda d: ["data.format=alpaca", f"data.path={write(d / 'x.jsonl', json.dumps({'instruction': 'a'}) + chr(10))}"],
                      r"x\.jsonl:1: not a valid 'alpaca' record: missing required field 'output'"),
    "wrong_format": (lambda d: ["data.format=alpaca", f"data.path={write(d / 'x.jsonl', json.dumps({'messages': [{'role': 'user', 'content': 'a'}, {'role': 'assistant', 'content': 'b'}]}) + chr(10))}"],
                     r"reads as data.format=(sharegpt|openai)"),
    "empty_dataset": (lambda d: [f"data.path={write(d / 'x.jsonl', '')}"], r"x\.jsonl: the file holds no examples"),
    "all_masked": (lambda d: [f"data.path={write(d / 'x.jsonl', json.dumps({'instruction': 'w ' * 60, 'output': 'x'}) + chr(10))}",
                              "data.max_seq_len=16"], r"every example was filtered out"),
    "missing_data_file": (lambda d: [f"data.path={d / 'nope.jsonl'}"], r"data.path=.*nope.jsonl: no such file"),
    "unknown_recipe": (lambda d: ["recipe=tiny_lorra"], r"unknown recipe 'tiny_lorra'. Did you mean 'tiny_lora'\?"),
    "misspelled_key": (lambda d: ["train.max_step=3"], r"unknown config key 'train.max_step'. Did you mean 'train.max_steps'\?"),
    "wrong_type": (lambda d: ["train.micro_batch_size=two"], r"config key 'train.micro_batch_size': expected integer, got 'two'"),
    "missing_model": (lambda d: [f"model.name_or_path={d / 'none'}"], r"no such dir, alias or hub id"),
    "not_a_model": (lambda d: [f"model.name_or_path={d}"], r"is not a model dir \(no config.json\)"),
    "rank_zero": (lambda d: ["method.r=0"], r"method.r=0 must be > 0"),
    "lr_negative": (lambda d: ["train.lr=-1e-4"], r"train.lr=-0.0001 must be > 0"),
    "seq_len_small": (lambda d: ["data.max_seq_len=8"], r"data.max_seq_len=8 is too small"),
    "eval_fraction": (lambda d: ["data.eval_fraction=-0.1"], r"data.eval_fraction=-0.1 must be in \[0, 1\)"),
    "broken_chat_template": (lambda d: ['data.chat_template="{% if %}"'], r"data.chat_template is not a valid Jinja template: .*line 1"),
    "unknown_attention": (lambda d: ["model.attn_implementation=flash"], r"model.attn_implementation='flash' is not one of auto, sdpa, eager"),
    "flash_attention_here": (lambda d: ["model.attn_implementation=flash_attention_2"],
                             r"flash_attention_2 (runs only on CUDA GPUs|needs the flash_attn package)"),
    "undetectable_format": (lambda d: [f"data.path={write(d / 'x.jsonl', json.dumps({'question': 'a', 'answer': 'b'}) + chr(10))}"],
                            r"x\.jsonl:1: data.format=auto cannot tell the format of a record with the fields 'answer', 'question'; "
                            r"set data.format to one of alpaca, "),
    "unknown_format": (lambda d: ["data.format=alpacca"], r"unknown data.format 'alpacca'. Did you mean 'alpaca'\?"),
    "invalid_utf8_line": (lambda d: [f"data.path={not_utf8_line(d)}"], r"x\.jsonl:2:20: not valid UTF-8 \(byte 0xff\); save the file as UTF-8"),
    "invalid_utf8_array": (lambda d: [f"data.path={not_utf8_array(d)}"], r"x\.json:2:14: not valid UTF-8 \(byte 0xe9\)"),
}


def not_utf8_line(d):
    return write_bytes(d / "x.jsonl", (json.dumps(GOOD) + "\n").encode() + b'{"instruction": "ab\xff", "output": "b"}\n')


def not_utf8_array(d):
    return write_bytes(d / "x.json", b"[" + json.dumps(GOOD).encode() + b',\n {"output": "\xe9t\xe9"}]')


def write_bytes(path, data: bytes):
    path.write_bytes(data)
    return path


@pytest.mark.parametrize("case", sorted(CASES))
def test_bad_input_is_one_clear_line(case, tmp_path, tiny_model_dir, capsys):
    make_args, expected = CASES[case]
    data_dir = tmp_path / "in"
    data_dir.mkdir()
    out = tmp_path / "run"
    args = ["train", "recipe=tiny_lora", f"model.name_or_path={tiny_model_dir}", f"output_dir={out}",
            "precision=fp32", "train.progress_bar=false", "train.tensorboard=false", *make_args(data_dir)]
    code = main(args)
    err = capsys.readouterr().err
    assert code in (1, 2)
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("ftctl: error: "), err
    import re

    assert re.search(expected, lines[0]), lines[0]
    assert not out.exists(), "a failed run left files behind"


def test_debug_shows_the_traceback_and_only_debug_does(tmp_path):
    import subprocess
    import sys

    from ftctl.errors import ConfigError

    with pytest.raises(ConfigError):
        main(["--debug", "train", "train.lrr=1"])
    plain, debug = (subprocess.run([sys.executable, "-m", "ftctl", *flag, "train", "train.lrr=1"], capture_output=True,
                                   text=True, timeout=120) for flag in ([], ["--debug"]))
    assert plain.returncode == 2 and "Traceback" not in plain.stderr
    assert plain.stderr.strip().splitlines() == [plain.stderr.strip()] and plain.stderr.startswith("ftctl: error: ")
    assert debug.returncode != 0 and "Traceback (most recent call last)" in debug.stderr and "ConfigError" in debug.stderr


@pytest.mark.parametrize("text, expected", [
    ("train:\n  lr: !!python/object/apply:os.system [\"touch {marker}\"]\n",
     r"x\.yaml:2: the YAML tag !!python/object/apply:os.system is not allowed: a config holds plain values, never objects"),
    ("method:\n  r: 8\ntrain:\n  lr: !custom 3\n", r"x\.yaml:4: the YAML tag !custom is not allowed"),
    (b"train:\n  lr: 1e-3\n# caf\xe9\n", r"x\.yaml:3:6: not valid UTF-8 \(byte 0xe9\)"),
])
def test_config_files_with_tags_or_bad_bytes_are_one_line(text, expected, tmp_path, capsys):
    import re

    marker = tmp_path / "ran"
    config = tmp_path / "x.yaml"
    config.write_bytes(text if isinstance(text, bytes) else text.format(marker=marker).encode())
    out = tmp_path / "run"
    assert main(["train", "--config", str(config), f"output_dir={out}", "precision=fp32"]) == 2
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip()]
    assert len(lines) == 1 and re.search(expected, lines[0]), lines
    assert not marker.exists() and not out.exists()


def test_a_model_saved_as_a_pickle_that_runs_code_is_refused_in_one_line(tmp_path, tiny_model_dir, capsys):
    import os
    import shutil

    import torch
    from safetensors.torch import load_file

    model = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model)
    marker = tmp_path / "ran"

    class Exploit:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    torch.save({**load_file(model / "model.safetensors"), "x": Exploit()}, model / "pytorch_model.bin")
    (model / "model.safetensors").unlink()
    out = tmp_path / "run"
    assert main(["train", "recipe=tiny_lora", f"model.name_or_path={model}", f"output_dir={out}", "precision=fp32"]) == 1
    lines = [line for line in capsys.readouterr().err.splitlines() if line.strip() and "%|" not in line]
    assert lines == [f"ftctl: error: {model / 'pytorch_model.bin'}: refused to unpickle: it would call posix.system (a pickle "
                     "can run code; ftctl loads tensors and plain data only); if you trust the file, convert it to safetensors"]
    assert not marker.exists() and not out.exists()
