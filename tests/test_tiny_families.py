"""build_tiny_model: every listed family builds locally, reloads, and is deterministic."""

from __future__ import annotations

import pytest


def test_every_family_builds_reloads_and_predicts(tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    from ftctl.models.tiny import TINY_FAMILIES, build_tiny_model

    ids = torch.tensor([[1, 5, 9, 20, 33]])
    for family in TINY_FAMILIES:
        out = build_tiny_model(family, tmp_path / family)
        model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32)
        assert model.config.model_type.removesuffix("_text") == family
        assert len(model.get_decoder().layers if family != "gpt2" else model.transformer.h) == 2
        logits = model(ids).logits
        assert logits.shape == (1, 5, model.config.vocab_size)
        assert torch.isfinite(logits).all() and logits.std() > 0.1, family


def test_same_seed_same_weights_and_unknown_family(tmp_path):
    from safetensors.torch import load_file

    from ftctl.models.tiny import build_tiny_model

    a = load_file(build_tiny_model("qwen3", tmp_path / "a") / "model.safetensors")
    b = load_file(build_tiny_model("qwen3", tmp_path / "b") / "model.safetensors")
    assert a.keys() == b.keys() and all((a[k] == b[k]).all() for k in a)
    with pytest.raises(ValueError, match="unknown family 'bloom'"):
        build_tiny_model("bloom", tmp_path / "c")
