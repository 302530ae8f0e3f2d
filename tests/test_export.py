"""`ftctl export`: GGUF files and transformers dirs that load back with the source's logits and token ids.

GGUF files are read back with transformers' own GGUF loader (which undoes llama.cpp's q/k row order),
never with ftctl code, so a wrong tensor name, permutation, hyperparameter or vocabulary entry shows
up as different logits or ids.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from ftctl.errors import FtctlError
from logit_checks import fp32_model, logits

SHORT_RUN = ("train.max_steps=3", "train.global_batch_size=4", "train.warmup_steps=0", "train.lr=1e-2")

#: max |logit difference| allowed after a GGUF round trip. Measured on the model below: f32 0, f16 4.8e-4,
#: bf16 4.4e-3, q8_0 1.3e-2; on the conftest tiny model (logits up to 3.4): f16 3.4e-3, bf16 2.4e-2,
#: q8_0 7.4e-2. The q8_0 bound is a sanity check, not a quality claim.
LOGIT_TOLERANCE = {"f32": 1e-4, "f16": 2e-2, "bf16": 1e-1, "q8_0": 0.3}

TEST_STRINGS = [
    "Hello, world!",
    "Reverse the word: owl",
    "punctuation: ([{<>}]) !?;:'\"`~@#$%^&*-_=+|\\/",
    "digits 0 12 345 6789 3.14159 -42 1e-5",
    "whitespace   runs\t\ttabs\n\nnewlines \n  \n   ",
    "  leading and trailing  ",
    "naïve café — Ωmega, 日本語, emoji 🚀🦙",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    "<pad><|endoftext|> specials inside text <|im_end|>",
]


def gguf_model(path: Path):
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)


def gguf_tokenizer(path: Path):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)


def gguf_fields(path: Path) -> dict:
    import gguf

    reader = gguf.GGUFReader(str(path))
    arrays = ("tokenizer.ggml.tokens", "tokenizer.ggml.token_type", "tokenizer.ggml.merges", "tokenizer.ggml.scores")
    fields = {k: f.contents() for k, f in reader.fields.items() if k not in arrays}
    fields["tensor_types"] = {t.name: t.tensor_type.name for t in reader.tensors}
    return fields


@pytest.fixture(scope="module")
def distinctive_model_dir(tmp_path_factory):
    """Tied embeddings and non-default rope theta / norm epsilon / context, so a dropped hyperparameter changes logits."""
    from ftctl.models.tiny import build_tiny_llama

    path = build_tiny_llama(tmp_path_factory.mktemp("distinctive"), tie_word_embeddings=True)
    config = json.loads((path / "config.json").read_text())
    config["rope_parameters"] = {"rope_type": "default", "rope_theta": 500.0}
    config["rms_norm_eps"] = 0.3
    config["max_position_embeddings"] = 256
    (path / "config.json").write_text(json.dumps(config))
    return path


@pytest.fixture(scope="module")
def exported(distinctive_model_dir, tmp_path_factory):
    """quant -> GGUF file of the distinctive model, written once per module."""
    from ftctl.export import ExportRequest, export_model

    root, files = tmp_path_factory.mktemp("gguf"), {}

    def get(quant: str) -> Path:
        if quant not in files:
            files[quant] = export_model(ExportRequest(model=str(distinctive_model_dir), format="gguf", output=str(root / f"m-{quant}.gguf"), quant=quant))
        return files[quant]

    return get


@pytest.mark.parametrize("quant", ["f32", "f16", "bf16", "q8_0"])
def test_gguf_round_trip_logits(quant, exported, distinctive_model_dir, record_property):
    path = exported(quant)
    difference = float((logits(gguf_model(path)) - logits(fp32_model(distinctive_model_dir))).abs().max())
    print(f"GGUF {quant}: max |logit diff| vs source {difference:.2e}")
    record_property(f"gguf_{quant}_max_logit_diff", difference)
    assert difference <= LOGIT_TOLERANCE[quant]
    if quant != "f32":
        assert difference > 0, "the weights were really converted"

    fields = gguf_fields(path)
    assert fields["general.architecture"] == "llama"
    assert fields["llama.rope.freq_base"] == 500.0 and fields["llama.context_length"] == 256
    assert fields["llama.attention.head_count"] == 4 and fields["llama.attention.head_count_kv"] == 2
    assert abs(fields["llama.attention.layer_norm_rms_epsilon"] - 0.3) < 1e-6
    types = fields["tensor_types"]
    assert "output.weight" not in types, "tied embeddings reuse token_embd"
    assert types["blk.0.attn_norm.weight"] == types["output_norm.weight"] == "F32"
    expected = {"f32": "F32", "f16": "F16", "bf16": "BF16", "q8_0": "Q8_0"}[quant]
    assert types["blk.1.ffn_down.weight"] == types["blk.0.attn_q.weight"] == types["token_embd.weight"] == expected


def test_gguf_without_the_rotary_permutation_would_not_match(distinctive_model_dir, tmp_path, monkeypatch):
    """The round-trip check above can fail: skip the q/k row permutation and the logits go wrong."""
    from ftctl.export import ExportRequest, export_model

    monkeypatch.setattr("ftctl.export.gguf_writer.interleave_rotary_rows", lambda weight, n_head: weight)
    path = export_model(ExportRequest(model=str(distinctive_model_dir), format="gguf", output=str(tmp_path / "m.gguf"), quant="f32"))
    assert (logits(gguf_model(path)) - logits(fp32_model(distinctive_model_dir))).abs().max() > 1e-2


def test_gguf_tokenizer_gives_the_source_ids(exported, distinctive_model_dir):
    from transformers import AutoTokenizer

    path = exported("q8_0")
    source, loaded = AutoTokenizer.from_pretrained(distinctive_model_dir), gguf_tokenizer(path)
    for text in TEST_STRINGS:
        assert loaded.encode(text) == source.encode(text), text
        assert loaded.decode(source.encode(text)) == source.decode(source.encode(text)), text
    conversation = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Add 2 and 3"}, {"role": "assistant", "content": "5"}]
    assert loaded.chat_template == source.chat_template
    assert loaded.apply_chat_template(conversation, tokenize=True, return_dict=False) == \
        source.apply_chat_template(conversation, tokenize=True, return_dict=False)
    assert (loaded.eos_token, loaded.pad_token, loaded.bos_token) == ("<|im_end|>", "<pad>", None)
    fields = gguf_fields(path)
    assert fields["tokenizer.ggml.model"] == "gpt2" and fields["tokenizer.ggml.pre"] == "default", "a tokenizer llama.cpp does not know"
    assert fields["tokenizer.ggml.add_bos_token"] is False


def test_gguf_pre_tokenizer_is_named_by_the_tokenizers_ids_for_llama_cpps_check_text(tiny_model_dir, tmp_path, monkeypatch, caplog):
    """As llama.cpp's converter does: the hash of the ids the tokenizer gives the check text picks the name;
    a tokenizer the table does not know gets `default` and one warning line."""
    import hashlib

    from transformers import AutoModelForCausalLM, AutoTokenizer

    from ftctl.export import gguf_vocab
    from ftctl.export.gguf_writer import write_gguf

    table = gguf_vocab.pre_tokenizer_table()
    assert len(table["names"]) > 80 and table["names"]["855059429035d75a914d1eda9f10a876752e281a054a7a3d421ef0533e5b6249"] == "smollm"
    model, tokenizer = AutoModelForCausalLM.from_pretrained(tiny_model_dir), AutoTokenizer.from_pretrained(tiny_model_dir)
    with caplog.at_level("INFO", logger="ftctl"):
        path = write_gguf(model, tokenizer, tmp_path / "unknown.gguf", "f32")
    assert gguf_fields(path)["tokenizer.ggml.pre"] == "default"
    warnings = [r.getMessage() for r in caplog.records if r.levelname == "WARNING"]
    digest = hashlib.sha256(str(tokenizer.encode(table["check_text"])).encode()).hexdigest()
    assert len(warnings) == 1 and "\n" not in warnings[0], warnings
    assert f"check hash {digest[:12]}" in warnings[0] and "`default` pre-tokenizer" in warnings[0] and "other tokens" in warnings[0]

    known = {**table, "names": {**table["names"], digest: "llama-bpe"}}
    monkeypatch.setattr(gguf_vocab, "pre_tokenizer_table", lambda: known)
    caplog.clear()
    with caplog.at_level("INFO", logger="ftctl"):
        path = write_gguf(model, tokenizer, tmp_path / "known.gguf", "f32")
    assert gguf_fields(path)["tokenizer.ggml.pre"] == "llama-bpe"
    assert not any("does not know this tokenizer" in r.getMessage() for r in caplog.records)


def test_gguf_tensor_names_are_llama_cpps(tiny_model_dir):
    """Every tensor of a Llama under its llama.cpp name; q/k marked for the rotary permutation; no place for the rest."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from ftctl.export.tensor_names import gguf_tensor_name

    config = AutoConfig.from_pretrained(tiny_model_dir)
    with torch.device("meta"):
        names = list(AutoModelForCausalLM.from_config(config).state_dict())
    mapped = {name: gguf_tensor_name(name, "llama", config.num_hidden_layers) for name in names}
    assert {gguf for gguf, _ in mapped.values()} == {"token_embd.weight", "output_norm.weight", "output.weight"} | {
        f"blk.{i}.{part}.weight" for i in range(config.num_hidden_layers)
        for part in ("attn_norm", "attn_q", "attn_k", "attn_v", "attn_output", "ffn_norm", "ffn_gate", "ffn_up", "ffn_down")
    }
    assert mapped["model.layers.1.self_attn.q_proj.weight"] == ("blk.1.attn_q.weight", "num_attention_heads")
    assert mapped["model.layers.1.self_attn.k_proj.weight"] == ("blk.1.attn_k.weight", "num_key_value_heads")
    assert gguf_tensor_name("model.layers.0.self_attn.q_norm.weight", "llama", 2) == (None, None)
    assert gguf_tensor_name("model.layers.0.self_attn.q_norm.weight", "qwen3", 2) == ("blk.0.attn_q_norm.weight", None)


def test_gguf_sentencepiece_tokenizer_round_trip(tmp_path):
    """A Llama-2 style tokenizer (byte fallback, ▁ for spaces) is written as tokenizer.ggml.model=llama."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    from ftctl.export.gguf_writer import write_gguf
    from ftctl.paths import samples_dir

    texts = [line for p in sorted(samples_dir().glob("*.jsonl")) for line in p.read_text().splitlines()]
    trainer = Tokenizer(models.BPE(byte_fallback=True, unk_token="<unk>"))
    trainer.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=True)
    pieces = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    trainer.train_from_iterator(texts, trainer=trainers.BpeTrainer(vocab_size=420, special_tokens=pieces, limit_alphabet=60, show_progress=False))
    trained = json.loads(trainer.to_str())["model"]
    # As in Llama 2's tokenizer.json: byte pieces are ordinary vocabulary, only <unk> <s> </s> (and chat markers) are added tokens.
    tok = Tokenizer(models.BPE(vocab=trained["vocab"], merges=[tuple(m) for m in trained["merges"]], byte_fallback=True, unk_token="<unk>", fuse_unk=True))
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first", split=False)
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(), decoders.Strip(" ", 1, 0)])
    tok.add_special_tokens(["<unk>", "<s>", "</s>", "<|im_start|>", "<|im_end|>", "<pad>", "<|endoftext|>"])
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>").save_pretrained(tmp_path / "tok")
    source = AutoTokenizer.from_pretrained(tmp_path / "tok")

    config = LlamaConfig(vocab_size=len(source) + 6, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=2)
    path = write_gguf(LlamaForCausalLM(config), source, tmp_path / "spm.gguf", "f32")
    loaded = gguf_tokenizer(path)
    for text in TEST_STRINGS:
        ids = source.encode(text)
        assert loaded.encode(text) == ids, text
        assert loaded.decode(ids, skip_special_tokens=True) == source.decode(ids, skip_special_tokens=True), text
    assert source.encode("x")[0] == loaded.bos_token_id == 1

    import gguf

    reader = gguf.GGUFReader(str(path))
    assert reader.fields["tokenizer.ggml.model"].contents() == "llama"
    types = reader.fields["tokenizer.ggml.token_type"].contents()
    assert types[3] == types[258] == gguf.TokenType.BYTE and types[0] == gguf.TokenType.UNKNOWN
    assert types[-1] == gguf.TokenType.UNUSED, "ids the model embeds beyond the tokenizer are padding"
    scores = reader.fields["tokenizer.ggml.scores"].contents()
    merged = [source.convert_tokens_to_ids("".join(m)) for m in json.loads(source.backend_tokenizer.to_str())["model"]["merges"][:50]]
    assert [scores[i] for i in merged] == sorted((scores[i] for i in merged), reverse=True), "earlier merges score higher"


def test_hf_export_is_sharded_and_loads_with_plain_transformers(tiny_model_dir, tmp_path, capsys):
    from transformers import AutoTokenizer

    from ftctl.cli import main
    from ftctl.models.aliases import model_dir_problems

    out = tmp_path / "hf"
    assert main(["export", f"model={tiny_model_dir}", "format=hf", f"output={out}", "shard_size=100KB"]) == 0
    assert f"-> {out}" in capsys.readouterr().out
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) >= 3 and all((out / s).stat().st_size <= 140_000 for s in shards)  # one tensor may exceed the limit alone
    assert {"config.json", "generation_config.json", "tokenizer.json", "chat_template.jinja"} <= {p.name for p in out.iterdir()}
    assert model_dir_problems(out) == []
    assert (logits(fp32_model(out)) - logits(fp32_model(tiny_model_dir))).abs().max() <= 1e-6
    loaded, source = AutoTokenizer.from_pretrained(out), AutoTokenizer.from_pretrained(tiny_model_dir)
    assert loaded.chat_template == source.chat_template and [loaded.encode(t) for t in TEST_STRINGS] == [source.encode(t) for t in TEST_STRINGS]

    half = tmp_path / "hf-bf16"
    assert main(["export", f"model={tiny_model_dir}", "format=hf", f"output={half}", "dtype=bfloat16"]) == 0
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(half).dtype == torch.bfloat16


def test_export_merges_an_adapter_on_the_way(make_cfg, run_training, tiny_model_dir, tmp_path, capsys, record_property):
    from peft import PeftModel

    from ftctl.cli import main

    result, _ = run_training(make_cfg("method=lora", *SHORT_RUN))
    expected = logits(PeftModel.from_pretrained(fp32_model(tiny_model_dir), str(result.final_dir)))
    assert (expected - logits(fp32_model(tiny_model_dir))).abs().max() > 1e-3, "the adapter changed the model"

    gguf_file = tmp_path / "run.gguf"
    assert main(["export", f"model={result.run_dir}", "format=gguf", "gguf.quant=f32", f"output={gguf_file}"]) == 0
    difference = float((logits(gguf_model(gguf_file)) - expected).abs().max())
    record_property("adapter_gguf_f32_max_logit_diff", difference)
    assert difference <= 1e-4
    assert "output.weight" in gguf_fields(gguf_file)["tensor_types"], "untied lm_head is written"

    checkpoint_out = tmp_path / "hf"
    assert main(["export", f"model={result.final_dir}", "format=hf", f"output={checkpoint_out}"]) == 0
    assert (logits(fp32_model(checkpoint_out)) - expected).abs().max() <= 1e-4
    assert not any(p.name.startswith("adapter_") for p in checkpoint_out.iterdir())
    assert "Traceback" not in capsys.readouterr().err


def test_unsupported_architectures_and_features_are_refused(tmp_path, capsys):
    from transformers import LlamaConfig

    from ftctl.cli import main
    from ftctl.export.gguf_writer import gguf_refusal

    gpt2 = tmp_path / "gpt2"
    gpt2.mkdir()
    (gpt2 / "config.json").write_text(json.dumps({"model_type": "gpt2", "architectures": ["GPT2LMHeadModel"]}))
    assert main(["export", f"model={gpt2}", "format=gguf", f"output={tmp_path / 'm.gguf'}"]) == 1
    err = capsys.readouterr().err
    assert "GGUF export of model_type gpt2 (GPT2LMHeadModel)" in err and "ftctl does not write it yet" in err and "format=hf" in err
    assert not (tmp_path / "m.gguf").exists() and "Traceback" not in err

    assert "bias" in gguf_refusal(LlamaConfig(attention_bias=True))
    assert "rope_type=yarn" in gguf_refusal(LlamaConfig(rope_parameters={"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e4}))
    assert gguf_refusal(LlamaConfig()) is None


@pytest.mark.parametrize(
    "args, message",
    [
        (["format=gguf", "output=x.gguf"], "export needs model=..."),
        (["model=m", "format=onnx", "output=x"], "format=onnx is not one of hf, gguf"),
        (["model=m", "format=gguf", "output=x.gguf", "gguf.quant=q4_0"], "gguf.quant=q4_0 is not one of f32, f16, bf16, q8_0, q4_k_m, q5_k_m, q6_k"),
        (["model=m", "format=gguf", "output=x.gguf", "quant=f32", "gguf.quant=f16"], "say different things"),
        (["model=m", "format=gguf", "output=x.gguf", "dtype=float16"], "dtype does not apply to format=gguf"),
        (["model=m", "format=hf", "output=x", "shard_size=lots"], "shard_size=lots: write a size such as 2GB"),
        (["model=m", "format=gguf", "output=x.bin"], "give it a name ending in .gguf"),
        (["model=m", "format=hf", "output=x.gguf"], "format=hf writes a model dir; for one GGUF file use format=gguf"),
        (["model=m", "format=gguf", "outptu=x.gguf"], "unknown export option 'outptu'. Did you mean 'output'?"),
        (["model=m", "format=hf", "output=x", "overwrite=maybe"], "overwrite=maybe: expected true or false"),
    ],
)
def test_export_arguments_are_checked(args, message, capsys):
    from ftctl.cli import main

    assert main(["export", *args]) != 0
    err = capsys.readouterr().err
    assert message in err and err.startswith("ftctl: error:")


def test_existing_output_is_kept_unless_overwrite(exported, distinctive_model_dir, capsys, tmp_path):
    import shutil

    from ftctl.cli import main

    # A copy: the module's cached f16 file must stay f16 for the round-trip tests, whatever their order.
    path = Path(shutil.copy(exported("f16"), tmp_path / "m.gguf"))
    before = path.stat().st_mtime_ns
    assert main(["export", f"model={distinctive_model_dir}", "format=gguf", f"output={path}"]) == 1
    assert "exists; choose another name or pass overwrite=true" in capsys.readouterr().err
    assert path.stat().st_mtime_ns == before
    assert main(["export", f"model={distinctive_model_dir}", "format=gguf", f"output={path}", "quant=q8_0", "overwrite=true"]) == 0
    assert gguf_fields(path)["tensor_types"]["blk.0.attn_q.weight"] == "Q8_0"
    assert not list(path.parent.glob(".*partial*"))


def test_llama3_rope_factors_match_transformers():
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    from ftctl.export.gguf_families import llama3_rope_factors

    rope = {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    config = LlamaConfig(hidden_size=2048, num_attention_heads=16, max_position_embeddings=131072, rope_parameters=rope)
    scaled, _ = ROPE_INIT_FUNCTIONS["llama3"](config, "cpu")
    dim = 2048 // 16
    plain = 1.0 / (500000.0 ** (torch.arange(0, dim, 2, dtype=torch.float64) / dim))
    factors = llama3_rope_factors(config)
    # llama.cpp divides each base frequency by its factor.
    np.testing.assert_allclose(plain.numpy() / factors, scaled.double().numpy(), rtol=1e-5)
    assert factors.min() == 1.0 and factors.max() == 8.0


def test_bpe_without_byte_level_or_byte_fallback_is_refused(tiny_model_dir):
    """llama.cpp's BPE reads tokens in GPT-2's byte alphabet; a plain character BPE has no GGUF spelling."""
    from tokenizers import pre_tokenizers
    from transformers import AutoTokenizer

    from ftctl.export.gguf_vocab import vocab_for_gguf

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert vocab_for_gguf(tokenizer, len(tokenizer)).model == "gpt2"
    tokenizer.backend_tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    with pytest.raises(FtctlError, match="BPE without a byte-level pre-tokenizer .*Export format=hf"):
        vocab_for_gguf(tokenizer, len(tokenizer))


@pytest.mark.parametrize("quant", ["q4_k_m", "q5_k_m", "q6_k"])
def test_k_quants_without_llama_cpp_are_refused_in_one_line_before_loading(quant, tiny_model_dir, tmp_path, monkeypatch, capsys):
    from ftctl.cli import main
    from ftctl.export import llamacpp

    def no_loading(*args, **kwargs):
        raise AssertionError("the refusal should come before the model loads")

    monkeypatch.setattr(llamacpp, "available", lambda: False)
    monkeypatch.setattr("ftctl.evaluation.evaluate.load_model", no_loading)
    output = tmp_path / "m.gguf"
    assert main(["export", f"model={tiny_model_dir}", "format=gguf", f"gguf.quant={quant}", f"output={output}"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"ftctl: error: gguf.quant={quant} is written by llama.cpp's own quantizer") and err.count("\n") == 1
    assert "pip install 'ftctl[llamacpp]'" in err and not output.exists()
