"""GGUF export of every family llama.cpp reads that ftctl writes, read back by transformers' own GGUF loader.

Each family is a tiny random model built here (no downloads) with the shared byte-level tokenizer,
its 1-D weights (norms, biases) randomised so that a norm written without Gemma's ``1 + w``, a
swapped norm or a dropped bias changes the logits. The round trip goes through transformers'
loader, which reads names, metadata and conventions the way llama.cpp's converter writes them.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

from logit_checks import fp32_model, logits

#: Per family: the transformers config beyond the common tiny sizes. Head sizes are the ones
#: transformers' GGUF loader assumes when a file does not say (Qwen3 128, Gemma 256 with a query
#: scale of 1/sqrt(256)), so the loaded model is the source model; llama.cpp reads them from the file.
FAMILY_CONFIGS = {
    "mistral": dict(head_dim=16, sliding_window=4096),
    "qwen2": dict(tie_word_embeddings=True),
    "qwen3": dict(head_dim=128),
    "gemma2": dict(tie_word_embeddings=True, head_dim=256, query_pre_attn_scalar=256, num_attention_heads=2, num_key_value_heads=1, sliding_window=8),
    "gemma3_text": dict(tie_word_embeddings=True, head_dim=256, query_pre_attn_scalar=256, num_attention_heads=2, num_key_value_heads=1, sliding_window=8,
                        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1_000_000.0},
                                         "sliding_attention": {"rope_type": "default", "rope_theta": 10_000.0}}),
    "phi3": dict(original_max_position_embeddings=256),
    # The loader reads no expert width back and assumes Qwen3-MoE's 768.
    "qwen3_moe": dict(head_dim=16, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=768, norm_topk_prob=True),
    "mixtral": dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None),
}
#: Families transformers' GGUF loader cannot read back (a llama file with experts): checked against the file only.
NOT_LOADABLE = {"mixtral"}
#: llama.cpp architecture each family is written as, and metadata it must carry (beyond the common keys).
EXPECTED = {
    "mistral": ("llama", {"llama.rope.dimension_count": 16}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {"qwen3.attention.key_length": 128}),
    "gemma2": ("gemma2", {"gemma2.attn_logit_softcapping": 50.0, "gemma2.final_logit_softcapping": 30.0,
                          "gemma2.attention.sliding_window": 8, "gemma2.attention.key_length": 256}),
    "gemma3_text": ("gemma3", {"gemma3.attention.sliding_window": 8, "gemma3.rope.freq_base": 1_000_000.0,
                               "gemma3.rope.freq_base_swa": 10_000.0}),
    "phi3": ("phi3", {"phi3.rope.scaling.original_context_length": 256, "phi3.attention.sliding_window": 0}),
    "qwen3_moe": ("qwen3moe", {"qwen3moe.expert_count": 4, "qwen3moe.expert_used_count": 2,
                               "qwen3moe.expert_feed_forward_length": 768}),
    "mixtral": ("llama", {"llama.expert_count": 4, "llama.expert_used_count": 2}),
}
#: max |logit difference| after the round trip (measured: f32 0 for every family; f16 up to 5e-3).
TOLERANCE = {"f32": 1e-5, "f16": 2e-2}


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory):
    from ftctl.models.tiny import build_tokenizer

    path = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(path)
    return path


def build_family_model(model_type: str, out: Path, tokenizer_dir: Path, **overrides) -> Path:
    """A 2-layer random ``model_type`` model with the shared tokenizer, saved to ``out``."""
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    settings = dict(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=256, rms_norm_eps=1e-5, tie_word_embeddings=False,
        bos_token_id=None, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id,
        initializer_range=0.1,
    )
    settings.update(FAMILY_CONFIGS[model_type])
    settings.update(overrides)
    config = AutoConfig.for_model(model_type, **settings)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        for parameter in model.parameters():
            if parameter.ndim == 1:  # norms and biases: away from their init, so a mishandled one shows
                parameter.add_(0.3 * torch.randn_like(parameter))
    model.save_pretrained(out)
    for item in tokenizer_dir.iterdir():
        shutil.copy(item, out / item.name)
    return out


@pytest.fixture(scope="module")
def family_dirs(tokenizer_dir, tmp_path_factory):
    built = {}

    def get(model_type: str) -> Path:
        if model_type not in built:
            built[model_type] = build_family_model(model_type, tmp_path_factory.mktemp(model_type), tokenizer_dir)
        return built[model_type]

    return get


def export(model_dir: Path, output: Path, quant: str) -> Path:
    """The writer alone: Gemma 2 loads only with eager attention, which `ftctl export` picks per model elsewhere.

    The stored name is fixed: llama.cpp applies Phi-3's token rules to any model named like Phi-3 (a file
    named phi3-f32.gguf), which the shared tokenizer cannot satisfy."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ftctl.export.gguf_writer import write_gguf

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    return write_gguf(model, AutoTokenizer.from_pretrained(model_dir), output, quant, name="tiny test model")


def gguf_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)


def read_gguf(path: Path):
    import gguf

    reader = gguf.GGUFReader(str(path))
    skip = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges")
    fields = {key: field.contents() for key, field in reader.fields.items() if key not in skip}
    tensors = {t.name: t for t in reader.tensors}
    return fields, tensors


@pytest.mark.parametrize("model_type", sorted(set(FAMILY_CONFIGS) - NOT_LOADABLE))
def test_family_round_trip_gives_the_source_logits(model_type, family_dirs, tmp_path, record_property):
    source_dir = family_dirs(model_type)
    source = logits(fp32_model(source_dir))
    for quant in ("f32", "f16"):
        path = export(source_dir, tmp_path / f"{model_type}-{quant}.gguf", quant)
        difference = float((logits(gguf_model(path)) - source).abs().max())
        print(f"{model_type} GGUF {quant}: max |logit diff| {difference:.2e}")
        record_property(f"gguf_{model_type}_{quant}_max_logit_diff", difference)
        assert difference <= TOLERANCE[quant], (model_type, quant, difference)

    from transformers import AutoTokenizer

    if model_type == "qwen2":
        # transformers loads a qwen2 dir's tokenizer with Qwen2's split rules over the shared vocabulary: a tokenizer
        # llama.cpp's table does not know, so the file names `default` (with a warning) and reads back with GPT-2's rules.
        assert read_gguf(path)[0]["tokenizer.ggml.pre"] == "default"
        return
    source_tokenizer = AutoTokenizer.from_pretrained(source_dir)
    loaded_tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    conversation = [{"role": "user", "content": "naïve café, 3.14 <|im_end|>  x"}, {"role": "assistant", "content": "ok"}]
    assert loaded_tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=False) == \
        source_tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=False)


@pytest.mark.parametrize("model_type", sorted(FAMILY_CONFIGS))
def test_family_file_has_llama_cpp_names_metadata_and_conventions(model_type, family_dirs, tmp_path):
    """Checked against gguf-py's own lists (llama.cpp's), independently of transformers' loader."""
    import gguf

    source_dir = family_dirs(model_type)
    path = export(source_dir, tmp_path / "m.gguf", "f32")
    fields, tensors = read_gguf(path)
    arch, expected_fields = EXPECTED[model_type]
    config = json.loads((source_dir / "config.json").read_text())
    assert fields["general.architecture"] == arch
    for key, value in expected_fields.items():
        assert fields[key] == pytest.approx(value), key
    assert fields[f"{arch}.block_count"] == 2 and fields[f"{arch}.embedding_length"] == 64
    assert fields[f"{arch}.attention.head_count"] == config["num_attention_heads"]
    assert fields[f"{arch}.attention.head_count_kv"] == config["num_key_value_heads"]
    assert fields[f"{arch}.context_length"] == 256 and fields[f"{arch}.feed_forward_length"] == 128

    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == arch)
    allowed = {gguf.TENSOR_NAMES[t].format(bid=b) for t in gguf.MODEL_TENSORS[arch_id] for b in range(2)}
    assert {name.rsplit(".", 1)[0] for name in tensors} <= allowed, "every tensor is one llama.cpp's architecture has"
    assert ("output.weight" in tensors) == (not config.get("tie_word_embeddings", False))

    weights = {name: tensor.detach() for name, tensor in fp32_model(source_dir).state_dict().items()}  # in memory layout: fused experts
    source_norm = weights["model.layers.0.input_layernorm.weight"].numpy()
    written_norm = np.asarray(tensors["blk.0.attn_norm.weight"].data)
    offset = 1.0 if arch.startswith("gemma") else 0.0  # Gemma's x * (1 + w) as llama.cpp's x * w
    np.testing.assert_array_equal(written_norm, source_norm + np.float32(offset))
    if arch == "phi3":
        assert tensors["blk.0.attn_qkv.weight"].shape.tolist() == [64, 16 * (4 + 2 + 2)]
        assert tensors["blk.0.ffn_up.weight"].shape.tolist() == [64, 2 * 128], "gate and up stay fused"
    if arch == "qwen2":
        np.testing.assert_array_equal(np.asarray(tensors["blk.1.attn_k.bias"].data), weights["model.layers.1.self_attn.k_proj.bias"].numpy())
    if arch in ("qwen3", "gemma3"):
        assert "blk.1.attn_q_norm.weight" in tensors and "blk.1.attn_k_norm.weight" in tensors
    if arch not in ("llama", "phi3"):  # only llama.cpp's llama graph rotates interleaved pairs
        np.testing.assert_array_equal(np.asarray(tensors["blk.0.attn_q.weight"].data), weights["model.layers.0.self_attn.q_proj.weight"].numpy())
    if config.get("num_local_experts") or config.get("num_experts"):
        fused = weights["model.layers.1.mlp.experts.gate_up_proj"].numpy()
        width = fused.shape[1] // 2
        np.testing.assert_array_equal(np.asarray(tensors["blk.1.ffn_gate_exps.weight"].data), fused[:, :width])
        np.testing.assert_array_equal(np.asarray(tensors["blk.1.ffn_up_exps.weight"].data), fused[:, width:])
        np.testing.assert_array_equal(np.asarray(tensors["blk.1.ffn_down_exps.weight"].data), weights["model.layers.1.mlp.experts.down_proj"].numpy())
        np.testing.assert_array_equal(np.asarray(tensors["blk.1.ffn_gate_inp.weight"].data), weights["model.layers.1.mlp.gate.weight"].numpy())
    if arch == "llama":
        assert not np.array_equal(np.asarray(tensors["blk.0.attn_q.weight"].data), weights["model.layers.0.self_attn.q_proj.weight"].numpy())


def test_cli_export_of_a_family(family_dirs, tmp_path, capsys):
    from ftctl.cli import main

    source_dir = family_dirs("qwen3")
    output = tmp_path / "qwen3.gguf"
    assert main(["export", f"model={source_dir}", "format=gguf", "gguf.quant=f32", f"output={output}"]) == 0
    assert "Traceback" not in capsys.readouterr().err
    assert (logits(gguf_model(output)) - logits(fp32_model(source_dir))).abs().max() <= TOLERANCE["f32"]


def test_gemma_without_the_norm_offset_would_not_match(family_dirs, tmp_path, monkeypatch):
    """The round trip can fail: write Gemma's norms as stored in transformers and the logits go wrong."""
    import dataclasses

    from ftctl.export import gguf_families

    source_dir = family_dirs("gemma2")
    broken = dataclasses.replace(gguf_families.FAMILIES["gemma2"], norm_offset=0.0)
    monkeypatch.setitem(gguf_families.FAMILIES, "gemma2", broken)
    path = export(source_dir, tmp_path / "m.gguf", "f32")
    assert (logits(gguf_model(path)) - logits(fp32_model(source_dir))).abs().max() > 1e-2


@pytest.mark.parametrize(
    "model_type, overrides, message",
    [
        ("gemma2", {"query_pre_attn_scalar": 224}, "query_pre_attn_scalar=224 (llama.cpp's gemma2 scales queries by 1/sqrt(256))"),
        ("gemma2", {"layer_types": ["full_attention", "full_attention"]}, "layer_types (llama.cpp's gemma2 fixes them: one full-attention layer in every 2"),
        ("gemma2", {"final_logit_softcapping": None}, "final_logit_softcapping=null (llama.cpp's gemma2 always soft-caps)"),
        ("gemma2", {"tie_word_embeddings": False}, "an lm_head of its own (llama.cpp's gemma2 reuses token_embd"),
        ("gemma3_text", {"attn_logit_softcapping": 50.0}, "attn_logit_softcapping (llama.cpp's gemma3 has none)"),
        ("qwen2", {"use_sliding_window": True, "sliding_window": 64}, "use_sliding_window=true"),
        ("phi3", {"hidden_act": "gelu"}, "hidden_act=gelu (llama.cpp's phi3 applies silu)"),
        ("qwen3_moe", {"norm_topk_prob": False}, "norm_topk_prob=false (llama.cpp's qwen3moe renormalises"),
        ("qwen3_moe", {"mlp_only_layers": [1]}, "dense MLP layers among the expert layers"),
        ("qwen3", {"rope_parameters": {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6,
                                       "original_max_position_embeddings": 64}}, "rope_type=yarn"),
    ],
)
def test_conventions_llama_cpp_cannot_express_are_refused(model_type, overrides, message, tokenizer_dir):
    from transformers import AutoConfig

    from ftctl.export.gguf_families import gguf_refusal

    settings = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, num_hidden_layers=2, intermediate_size=128, vocab_size=600)
    settings.update(FAMILY_CONFIGS[model_type])
    assert gguf_refusal(AutoConfig.for_model(model_type, **settings)) is None
    refusal = gguf_refusal(AutoConfig.for_model(model_type, **{**settings, **overrides}))
    assert refusal and message in refusal and "format=hf" in refusal and "\n" not in refusal


@pytest.mark.parametrize(
    "config, message",
    [
        ({"model_type": "olmo2", "architectures": ["Olmo2ForCausalLM"], "hidden_size": 64, "num_attention_heads": 4},
         "model_type olmo2 (Olmo2ForCausalLM): llama.cpp has a olmo2 architecture, but ftctl does not write it yet (it writes gemma2, gemma3_text, llama"),
        ({"model_type": "opt", "architectures": ["OPTForCausalLM"], "hidden_size": 64, "num_attention_heads": 4},
         "model_type opt (OPTForCausalLM): ftctl knows no llama.cpp architecture for it"),
        ({"model_type": "gemma3", "architectures": ["Gemma3ForConditionalGeneration"], "text_config": {"hidden_size": 64}},
         "model_type gemma3: a model with a vision tower; ftctl writes text-only models"),
    ],
)
def test_families_ftctl_does_not_write_are_refused_before_loading(config, message, tmp_path, capsys):
    from ftctl.cli import main

    model_dir = tmp_path / "model"
    model_dir.mkdir()
    (model_dir / "config.json").write_text(json.dumps(config))  # no weights: the refusal comes before loading
    assert main(["export", f"model={model_dir}", "format=gguf", f"output={tmp_path / 'm.gguf'}"]) == 1
    err = capsys.readouterr().err
    assert err.startswith("ftctl: error:") and message in err and "format=hf" in err
    assert "Traceback" not in err and not (tmp_path / "m.gguf").exists()


def test_phi3_longrope_factors_are_written_as_llama_cpp_reads_them(tokenizer_dir, tmp_path):
    """Phi-3-128k / Phi-3.5 scaling: the long and short factors as tensors, and the attention factor."""
    import math

    long_factor, short_factor = [1.0 + i / 8 for i in range(8)], [1.0 + i / 100 for i in range(8)]
    source_dir = build_family_model("phi3", tmp_path / "phi3", tokenizer_dir, max_position_embeddings=1024, rope_scaling={
        "type": "longrope", "long_factor": long_factor, "short_factor": short_factor})
    fields, tensors = read_gguf(export(source_dir, tmp_path / "m.gguf", "q8_0"))
    np.testing.assert_array_equal(np.asarray(tensors["rope_factors_long.weight"].data), np.float32(long_factor))
    np.testing.assert_array_equal(np.asarray(tensors["rope_factors_short.weight"].data), np.float32(short_factor))
    assert tensors["rope_factors_long.weight"].tensor_type.name == "F32"
    assert fields["phi3.rope.scaling.original_context_length"] == 256 and fields["phi3.context_length"] == 1024
    assert fields["phi3.rope.scaling.attn_factor"] == pytest.approx(math.sqrt(1 + math.log(4) / math.log(256)))


#: The GGUF column of the family matrix, over the tiny configs of ftctl.models.tiny.TINY_FAMILIES:
#: the llama.cpp architecture written, or the start of the one-line refusal.
GGUF_MATRIX = {
    "llama": "llama", "mistral": "llama", "mixtral": "llama", "qwen2": "qwen2", "qwen3": "qwen3",
    "gemma2": "gemma2", "gemma3": "gemma3", "phi3": "phi3",
    "qwen3_moe": "refused: GGUF export: llama.cpp's qwen3moe architecture cannot express this qwen3_moe model's norm_topk_prob=false",
    "olmo2": "refused: GGUF export of model_type olmo2 (Olmo2ForCausalLM): llama.cpp has a olmo2 architecture",
    "granite": "refused: GGUF export of model_type granite (GraniteForCausalLM): llama.cpp has a granite architecture",
    "smollm3": "refused: GGUF export of model_type smollm3 (SmolLM3ForCausalLM): llama.cpp has a smollm3 architecture",
    "gpt2": "refused: GGUF export of model_type gpt2 (GPT2LMHeadModel): llama.cpp has a gpt2 architecture",
    "gpt_oss": "refused: GGUF export of model_type gpt_oss (GptOssForCausalLM): llama.cpp has a gpt_oss architecture",
}
#: Tiny configs transformers' GGUF loader reads back as they are (it assumes Qwen3's and Gemma's real head sizes).
MATRIX_ROUND_TRIP = {"llama", "mistral", "qwen2", "phi3"}


def test_matrix_covers_every_tiny_family():
    from ftctl.models.tiny import TINY_FAMILIES

    assert set(GGUF_MATRIX) == set(TINY_FAMILIES)


@pytest.mark.parametrize("family", sorted(GGUF_MATRIX))
def test_every_tiny_family_exports_or_is_refused_before_loading(family, tmp_path, monkeypatch, capsys):
    import gguf

    from ftctl.cli import main
    from ftctl.models.tiny import build_tiny_model

    source_dir = build_tiny_model(family, tmp_path / family)
    capsys.readouterr()  # building writes progress bars
    output = tmp_path / f"tiny-{family}.gguf"  # transformers' loader misreads a llama file named exactly "mistral"
    expected = GGUF_MATRIX[family]
    if expected.startswith("refused: "):
        def no_loading(*args, **kwargs):
            raise AssertionError("the refusal should come before the model loads")

        monkeypatch.setattr("ftctl.evaluation.evaluate.load_model", no_loading)
        assert main(["export", f"model={source_dir}", "format=gguf", f"output={output}"]) == 1
        err = capsys.readouterr().err
        assert err.startswith("ftctl: error: " + expected.removeprefix("refused: ")) and err.count("\n") == 1, err
        assert "format=hf" in err and not output.exists()
        return

    path = export(source_dir, output, "f32")
    fields, tensors = read_gguf(path)
    assert fields["general.architecture"] == expected
    arch_id = next(k for k, v in gguf.MODEL_ARCH_NAMES.items() if v == expected)
    allowed = {gguf.TENSOR_NAMES[t].format(bid=b) for t in gguf.MODEL_TENSORS[arch_id] for b in range(2)}
    assert {name.rsplit(".", 1)[0] for name in tensors} <= allowed
    if family in MATRIX_ROUND_TRIP:
        assert (logits(gguf_model(path)) - logits(fp32_model(source_dir))).abs().max() <= TOLERANCE["f32"]
