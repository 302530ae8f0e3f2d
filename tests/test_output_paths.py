"""Every path a command writes: missing folders above it are created, and an output that cannot be written
(a file where a folder must be) is one line before any model loads."""

from __future__ import annotations

import json

import pytest

from ftctl.cli import main
from ftctl.paths import samples_dir


@pytest.fixture
def places(tmp_path, tiny_model_dir):
    run = tmp_path / "run"
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps({"step": s, "loss": 2.0 / s, "lr": 1e-3}) + "\n" for s in (1, 2, 3)))
    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text(json.dumps({"prompt": "Hi"}) + "\n")
    blocker = tmp_path / "blocker.txt"
    blocker.write_text("a file, where a command would need a folder")
    return {"run": run, "prompts": prompts, "blocker": blocker, "model": tiny_model_dir, "tmp": tmp_path,
            "sample": samples_dir() / "alpaca_sample.jsonl"}


COMMANDS = {
    "recipes cp": lambda p, out: ["recipes", "cp", "tiny_lora", f"{out}.yaml"],
    "plot": lambda p, out: ["plot", str(p["run"]), f"output={out}.png"],
    "merge": lambda p, out: ["merge", f"adapter={p['run']}", f"output={out}"],
    "export hf": lambda p, out: ["export", f"model={p['model']}", "format=hf", f"output={out}"],
    "export gguf": lambda p, out: ["export", f"model={p['model']}", "format=gguf", f"output={out}.gguf"],
    "generate": lambda p, out: ["generate", f"model={p['model']}", f"input={p['prompts']}", f"output={out}.jsonl", "max_new_tokens=2"],
    "eval": lambda p, out: ["eval", f"model={p['model']}", f"data.path={p['sample']}", f"output={out}", "n=2", "max_new_tokens=2"],
    "train output_dir": lambda p, out: ["train", "recipe=tiny_lora", f"output_dir={out}", "precision=fp32"],
    "train data.cache_dir": lambda p, out: ["train", "recipe=tiny_lora", f"data.cache_dir={out}", "precision=fp32",
                                            f"output_dir={p['tmp'] / 'fresh'}"],
}


@pytest.mark.parametrize("command", COMMANDS)
def test_an_output_under_a_file_is_one_line(capsys, places, command):
    args = COMMANDS[command](places, places["blocker"] / "sub" / "x")
    assert main(args) != 0
    err = capsys.readouterr().err
    assert err.startswith("ftctl: error: ") and err.count("\n") == 1, err
    assert f"{places['blocker']} is a file, so no folder can be made under it" in err
    assert not (places["tmp"] / "fresh").exists()


def test_a_file_or_dir_of_the_wrong_kind_is_one_line(capsys, places):
    assert main(["train", "recipe=tiny_lora", f"output_dir={places['blocker']}", "precision=fp32"]) == 1
    assert f"output_dir={places['blocker']} is a file; give the path of a directory" in capsys.readouterr().err
    assert main(["plot", str(places["run"]), f"output={places['tmp']}"]) == 1
    assert f"output={places['tmp']} is a directory; give the path of a file to write" in capsys.readouterr().err
    assert main(["plot", str(places["run"]), f"output={places['tmp'] / 'curve.pgn'}"]) == 1
    err = capsys.readouterr().err
    assert "curve.pgn: matplotlib writes" in err and ".png" in err and err.count("\n") == 1


@pytest.mark.parametrize("command", ["recipes cp", "plot", "export gguf", "generate"])
def test_missing_folders_above_an_output_are_created(capsys, places, command):
    out = places["tmp"] / "new" / "deeper" / "x"
    assert main(COMMANDS[command](places, out)) == 0, capsys.readouterr().err
    written = [p for p in out.parent.iterdir() if not p.name.startswith(".")]
    assert [p.name for p in written] == [out.name + {"recipes cp": ".yaml", "plot": ".png", "export gguf": ".gguf",
                                                      "generate": ".jsonl"}[command]]
    assert written[0].stat().st_size > 0
