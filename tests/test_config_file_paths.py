"""Config files (`ftctl train --config FILE`): both spellings of a defaults list, paths relative to the
file, the README's example file, and a run's own config.yaml keeping the command line's paths."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import yaml

from ftctl.cli import main
from ftctl.config.compose import compose_config, to_yaml
from ftctl.paths import samples_dir

README = Path(__file__).resolve().parent.parent / "README.md"
REQUIRED = "model:\n  name_or_path: tiny-llama\ndata:\n  path: {data}\n"


@pytest.mark.parametrize("entry", ["method: dora", "override /method: dora", "/method: dora", "override method: dora"])
def test_both_defaults_list_spellings_choose_a_group(tmp_path, entry):
    mine = tmp_path / "my.yaml"
    mine.write_text(f"defaults:\n  - {entry}\n  - precision: fp32\n" + REQUIRED.format(data=samples_dir() / "alpaca_sample.jsonl")
                    + "method:\n  r: 4\n")
    cfg = compose_config([], config_file=str(mine))
    assert (cfg.method.name, cfg.method.use_dora, cfg.method.r, cfg.precision.name) == ("dora", True, 4, "fp32")
    if entry == "method: dora":
        assert compose_config(["method=full"], config_file=str(mine)).method.name == "full"  # the command line still wins


@pytest.mark.parametrize(
    "defaults, message",
    [
        ("  - methd: dora\n", "{f}:3: 'methd' is not a config group. Did you mean 'method'? Groups: model, method"),
        ("  - method: dorra\n", "{f}:3: unknown method 'dorra'. Did you mean 'dora'? Available: dora, full, lora, qlora"),
        ("  - recipe: tiny_lora\n", "{f}:3: a config file cannot choose a recipe (the file is one)"),
        ("  - [method, dora]\n", "{f}:3: a defaults entry is one group choice such as '- method: dora'"),
    ],
)
def test_defaults_list_mistakes_name_the_file_and_line(capsys, tmp_path, defaults, message):
    bad = tmp_path / "bad.yaml"
    bad.write_text("# mine\ndefaults:\n" + defaults)
    assert main(["train", "--config", str(bad), "--cfg"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("ftctl: error: " + message.format(f=bad)) and err.count("\n") == 1


def test_paths_in_a_config_file_resolve_against_the_file(tmp_path, monkeypatch, tiny_model_dir):
    project = tmp_path / "project"
    (project / "configs").mkdir(parents=True)
    (project / "data").mkdir()
    shutil.copy(samples_dir() / "alpaca_sample.jsonl", project / "data" / "train.jsonl")
    (project / "configs" / "turns.jinja").write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}")
    (project / "configs" / "base").symlink_to(tiny_model_dir)
    mine = project / "configs" / "my.yaml"
    mine.write_text(
        "model:\n  name_or_path: base\n  config_file: llama-2-7b.json\n"
        "data:\n  eval_path: ../data/held.jsonl\n  chat_template: turns.jinja\n  cache_dir: cache\n"
        "  mixture:\n    - {path: ../data/train.jsonl, weight: 2}\n    - {path: org/name, format: sharegpt}\n"
        "  eval_sets:\n    held: ../data/held.jsonl\n    chats: {path: ../data/train.jsonl, format: alpaca}\n"
        "output_dir: runs/x\n"
    )
    monkeypatch.chdir(tmp_path)  # elsewhere: the file's directory decides, not this one
    cfg = compose_config(["precision=fp32"], config_file="project/configs/my.yaml")
    assert cfg.model.name_or_path == str(project / "configs" / "base")
    assert cfg.model.config_file == "llama-2-7b.json"  # a shipped architecture's name, not a file here
    assert cfg.data.mixture[0].path == str(project / "data" / "train.jsonl")
    assert cfg.data.mixture[1].path == "org/name"  # a hub id
    assert cfg.data.eval_path == str(project / "data" / "held.jsonl")  # missing, yet named where the file means it
    assert cfg.data.chat_template == str(project / "configs" / "turns.jinja")
    assert cfg.data.eval_sets["held"] == str(project / "data" / "held.jsonl")
    assert cfg.data.eval_sets["chats"]["path"] == str(project / "data" / "train.jsonl")
    assert (cfg.output_dir, cfg.data.cache_dir) == ("runs/x", "cache")  # what a run writes: the current directory
    # The same keys on the command line stay as typed (relative to the current directory).
    assert compose_config(["precision=fp32", "data.eval_path=held.jsonl"], config_file=str(mine)).data.eval_path == "held.jsonl"
    aliased = tmp_path / "aliased.yaml"
    aliased.write_text(REQUIRED.format(data="data.jsonl"))
    (tmp_path / "tiny-llama").mkdir()  # an alias stays an alias even where a dir of its name exists
    cfg = compose_config(["precision=fp32"], config_file=str(aliased))
    assert (cfg.model.name_or_path, cfg.data.path) == ("tiny-llama", str(tmp_path / "data.jsonl"))


def test_a_runs_own_config_keeps_the_command_lines_paths(capsys, tmp_path, monkeypatch):
    """resume=auto reads the run's config.yaml; its relative paths were typed relative to the current directory."""
    monkeypatch.chdir(tmp_path)
    shutil.copy(samples_dir() / "alpaca_sample.jsonl", tmp_path / "mine.jsonl")
    run = tmp_path / "runs" / "x"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(to_yaml(compose_config(["recipe=tiny_lora", "data.path=mine.jsonl", "output_dir=runs/x"])))
    assert main(["train", "output_dir=runs/x", "resume=auto", "--cfg"]) == 0
    out = capsys.readouterr().out
    assert yaml.safe_load(out[out.index("model:"):])["data"]["path"] == "mine.jsonl"


def test_the_readme_example_file_composes(tmp_path, monkeypatch):
    text = README.read_text()
    block = re.search(r"```yaml\n(# configs/orders\.yaml:.*?)```", text, re.S)
    assert block, "README lost its complete example config file"
    (tmp_path / "configs").mkdir()
    (tmp_path / "configs" / "orders.yaml").write_text(block.group(1))
    (tmp_path / "data").mkdir()
    for name in ("orders_train.alpaca.jsonl", "orders_heldout.alpaca.jsonl"):
        shutil.copy(samples_dir() / "demo" / name, tmp_path / "data" / name)
    monkeypatch.chdir(tmp_path / "data")
    cfg = compose_config([], config_file="../configs/orders.yaml")
    assert cfg.data.path == str(tmp_path / "data" / "orders_train.alpaca.jsonl")
    assert cfg.data.eval_path == str(tmp_path / "data" / "orders_heldout.alpaca.jsonl")
    assert (cfg.model.name_or_path, cfg.method.name, cfg.output_dir) == ("smollm2-135m-instruct", "lora", "runs/orders")
    assert cfg.precision.name == "fp32" and cfg.method.r == 8


def _code_spans(cell: str, *, outside_parentheses: bool) -> list:
    if outside_parentheses:
        cell = re.sub(r"\([^)]*\)", "", cell)
    return re.findall(r"`([^`]+)`", cell)


def test_the_readme_table_of_other_tools_keys_is_what_ftctl_answers():
    """Each key of axolotl, LLaMA-Factory and TRL in the README's table, given to ftctl, is answered with (one of)
    the ftctl keys of its row."""
    from ftctl.config.compose import _check_override, schema_fields  # the check every command-line key=value gets
    from ftctl.errors import ConfigError

    section = README.read_text().split("### Coming from axolotl, LLaMA-Factory or TRL", 1)[1].split("\n### ", 1)[0]
    rows = [line.strip("|").split("|") for line in section.splitlines() if line.startswith("| ") and "---" not in line][1:]
    assert len(rows) >= 25
    fields, checked = schema_fields(), 0
    for what, *theirs, ours in rows:
        answers = _code_spans(ours, outside_parentheses=False)
        assert answers, what
        for key in {k for cell in theirs for k in _code_spans(cell, outside_parentheses=True)}:
            if key in fields:  # the same name in ftctl (output_dir, seed)
                continue
            with pytest.raises(ConfigError) as info:
                _check_override(f"{key}=1", fields)
            assert any(answer in str(info.value) for answer in answers), (key, str(info.value), answers)
            checked += 1
    assert checked >= 50
