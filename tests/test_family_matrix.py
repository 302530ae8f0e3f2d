"""The family matrix: tiny random models of every supported family × LoRA, full, QLoRA, DoRA, packed LoRA,
merge and chat, in-process, two optimizer steps each. A cell either works or is refused before any
work with a one-line reason (asserted here), never trains a wrong loss or mixes packed examples.
Every step trains the same four examples, so a working cell's second loss is below its first; merge
and chat must give the trained model's own logits and greedy answer.
README's "Model families" table is this test's result.
"""

from __future__ import annotations

import math

import pytest
import torch

from ftctl.errors import FtctlError
from ftctl.models.tiny import TINY_FAMILIES, build_tiny_model

FAMILIES = list(TINY_FAMILIES)
MOE = {"mixtral", "qwen3_moe", "gpt_oss"}

#: Cells refused before work, with the text their one-line message must carry.
REFUSED = {
    ("gpt_oss", "packed_lora"): "GptOssForCausalLM mixes packed examples",
}

_models: dict = {}
_lora_runs: dict = {}


@pytest.fixture(scope="module")
def family_dirs(tmp_path_factory):
    def get(family):
        if family not in _models:
            _models[family] = build_tiny_model(family, tmp_path_factory.mktemp(f"tiny_{family}"))
        return _models[family]

    return get


@pytest.fixture(scope="module")
def four_examples(tmp_path_factory):
    """A global batch's worth of examples: both steps train on exactly these."""
    import json

    path = tmp_path_factory.mktemp("matrix_data") / "four.jsonl"
    rows = [{"instruction": f"Spell {w} backwards.", "output": w[::-1]} for w in ("ocean", "timber", "lantern", "maple")]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


_composed: dict = {}


def _config(family_dirs, data, *overrides):
    """The composed config of a cell kind; Hydra takes longer than the two training steps, so once per kind."""
    import copy

    from ftctl.config.compose import compose_config

    if overrides not in _composed:
        _composed[overrides] = compose_config([
            "recipe=tiny_lora",
            f"model.name_or_path={family_dirs('llama')}",
            "output_dir=unused",
            "overwrite=true",
            "precision=fp32",
            f"data.path={data}",
            "train.max_steps=2", "train.micro_batch_size=2", "train.global_batch_size=4", "train.warmup_steps=0",
            "data.max_seq_len=64",
            "train.progress_bar=false", "train.tensorboard=false",
            *overrides,
        ])
    return copy.deepcopy(_composed[overrides])


def _train(family_dirs, data, tmp_path_factory, family, *overrides):
    from ftctl.training.run_dir import prepare_run_dir
    from ftctl.training.metrics import read_metrics
    from ftctl.training.runner import train

    cfg = _config(family_dirs, data, *overrides)
    cfg.model.name_or_path = str(family_dirs(family))
    cfg.output_dir = str(tmp_path_factory.mktemp(f"run_{family}"))
    run_dir = prepare_run_dir(cfg)
    result = train(cfg, run_dir)
    losses = [m["loss"] for m in read_metrics(run_dir) if "loss" in m]
    return result, losses


def _lora_run(family_dirs, data, tmp_path_factory, family):
    if family not in _lora_runs:
        _lora_runs[family] = _train(family_dirs, data, tmp_path_factory, family, "method=lora")
    return _lora_runs[family]


def _expect(family, cell):
    reason = REFUSED.get((family, cell))
    return pytest.raises(FtctlError, match=reason) if reason else None


def _check_trained(result, losses):
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)
    assert losses[1] < losses[0], f"the loss did not fall on the batch it trained on: {losses}"
    assert result.final_dir.is_dir()


@pytest.mark.parametrize("family", FAMILIES)
@pytest.mark.parametrize("cell", ["lora", "full", "qlora", "dora", "packed_lora"])
def test_train_cell(family, cell, family_dirs, four_examples, tmp_path_factory):
    overrides = {
        "lora": ["method=lora"], "full": ["method=full"], "qlora": ["method=qlora"], "dora": ["method=dora"],
        "packed_lora": ["method=lora", "data.packing=true"],
    }[cell]
    refusal = _expect(family, cell)
    if refusal is not None:
        with refusal as info:
            _train(family_dirs, four_examples, tmp_path_factory, family, *overrides)
        assert "\n" not in str(info.value)
        return
    if cell == "lora":
        result, losses = _lora_run(family_dirs, four_examples, tmp_path_factory, family)
    else:
        result, losses = _train(family_dirs, four_examples, tmp_path_factory, family, *overrides)
    _check_trained(result, losses)


IDS = torch.tensor([[3, 17, 40, 99, 120, 7, 64, 250]])


def _logits(model, ids=IDS):
    with torch.no_grad():
        return model.eval()(input_ids=ids).logits


@pytest.mark.parametrize("family", FAMILIES)
def test_merge_cell(family, family_dirs, four_examples, tmp_path_factory):
    """The merged model gives the trained model's logits (the one in memory at the run's end) within 1e-4."""
    from transformers import AutoModelForCausalLM

    from ftctl.merging import merge_adapter

    result, _ = _lora_run(family_dirs, four_examples, tmp_path_factory, family)
    merged, _ = merge_adapter(result.final_dir)
    trained = _logits(result.model)
    assert (_logits(merged) - trained).abs().max().item() < 1e-4
    base = AutoModelForCausalLM.from_pretrained(family_dirs(family), dtype=torch.float32)
    assert (trained - _logits(base)).abs().max().item() > 1e-4  # the adapter trained: merging had something to fold in


@pytest.mark.parametrize("family", FAMILIES)
def test_chat_cell(family, family_dirs, four_examples, tmp_path_factory):
    """`ftctl chat` on the run's adapter loads the trained model (its logits) and answers with its greedy tokens."""
    import io

    from ftctl.chat import load_chat_model, run_chat
    from ftctl.evaluation.generation import generate

    result, _ = _lora_run(family_dirs, four_examples, tmp_path_factory, family)
    options = {"adapter": str(result.final_dir), "prompt": "hello", "max_new_tokens": "6", "temperature": "0"}
    loaded, tokenizer = load_chat_model(options)
    assert (_logits(loaded) - _logits(result.model)).abs().max().item() < 1e-4
    want = generate(result.model.eval(), tokenizer, [[{"role": "user", "content": "hello"}]], 6)[0]
    out, err = io.StringIO(), io.StringIO()
    rc = run_chat(options, stdout=out, stderr=err)
    assert rc == 0 and out.getvalue() == want + "\n", (out.getvalue(), want)
