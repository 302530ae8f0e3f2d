"""Preference objectives end to end on the tiny Llama: the log-prob kernel, packed pairs, the reference model
and its cache, every objective with every method, precisions, resume, the NaN guard, merge, eval, preview,
the data formats and the inputs refused in one line. The losses themselves: tests/test_preference_losses.py;
the distributed backends: tests/test_preference_parallel.py."""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
import torch

from ftctl.cli import main
from ftctl.errors import FtctlError
from ftctl.paths import samples_dir

PAIRS_FILE = samples_dir() / "preference" / "pairs_sample.jsonl"
KTO_FILE = samples_dir() / "preference" / "kto_sample.jsonl"
# Short runs: 2 steps of 4 pairs in micro-batches of 2.
SHORT = ("train.max_steps=2", "train.global_batch_size=4", "train.micro_batch_size=2")
REWARDS = ("rewards/chosen", "rewards/rejected", "rewards/margins", "rewards/accuracies", "logps/chosen", "logps/rejected",
           "truncated_share")


def write_jsonl(path: Path, rows) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def steps(metrics, key="loss"):
    return {m["step"]: m[key] for m in metrics if key in m}


@pytest.fixture
def dpo_cfg(make_cfg):
    return lambda *extra, **kw: make_cfg("objective=dpo", "data=preference_sample", "method.dropout=0.0", *SHORT, *extra, **kw)


@pytest.fixture(scope="module")
def tokenizer(tiny_model_dir):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tiny_model_dir)


def pair_data(tokenizer, path=PAIRS_FILE, data_format="preference", kind="pairs", **settings):
    from ftctl.config.schema import DataConfig
    from ftctl.data.preference import tokenize_preference
    from ftctl.data.records import read_records
    from ftctl.data.sources import locate

    cfg = DataConfig(format=data_format, path=str(path), **settings)
    return tokenize_preference(read_records(path), locate(str(path)), data_format, cfg, tokenizer, kind)


def dpo_loss_fn(reference):
    from ftctl.objectives import losses

    return lambda logps: losses.dpo(logps[0::2], logps[1::2], reference[0::2], reference[1::2], beta=0.5).losses.sum()


# ----------------------------------------------------------------------------------------------
# the kernel: fused head = plain logits; packed = padded


@pytest.mark.parametrize("adapted", [False, True], ids=["full", "lora"])
def test_fused_head_logps_loss_and_gradients_equal_full_logits(tiny_model_dir, tokenizer, adapted, monkeypatch):
    """The head that scores sequences in chunks (no full logits, gradients computed in forward) gives what
    log_softmax over full logits gives under autograd: per-sequence log-probs, the loss, every gradient
    (the head weight's too when it trains)."""
    from transformers import AutoModelForCausalLM

    import ftctl.objectives.logprobs as logprobs
    from ftctl.data.preference import PreferenceBatching
    from ftctl.training.loss import returns_head_output

    batch = PreferenceBatching(3, tokenizer.pad_token_id, 8)(pair_data(tokenizer), [0, 1, 2])[0]
    reference = -torch.rand(batch.num_sequences, generator=torch.Generator().manual_seed(0)) * 30

    def run(plain: bool):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        if adapted:
            from peft import LoraConfig, get_peft_model

            model = get_peft_model(model, LoraConfig(r=4, target_modules="all-linear", init_lora_weights=False))
        returns_head_output(model if not adapted else model.get_base_model())
        with monkeypatch.context() as patch:
            if plain:
                patch.setattr(logprobs, "head_for_loss", lambda module: None)
            loss, logps = logprobs.sequence_loss(model, batch, torch.device("cpu"), dpo_loss_fn(reference))
        loss.backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
        return loss.detach(), logps, grads

    fused, plain = run(False), run(True)
    torch.testing.assert_close(fused[1], plain[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(fused[0], plain[0], rtol=1e-5, atol=1e-6)
    assert fused[2].keys() == plain[2].keys() and (adapted or "lm_head.weight" in fused[2])
    for name in plain[2]:
        torch.testing.assert_close(fused[2][name], plain[2][name], rtol=1e-4, atol=1e-5, msg=lambda m, name=name: f"{name}: {m}")


def test_packed_pairs_equal_padded(tiny_model_dir, tokenizer):
    """Pairs through the packed path (shared rows, positions restarting, per-example attention) score each
    sequence as the padded path does, within 1e-5 in fp32, loss and gradients included."""
    from ftctl.data.preference import PreferenceBatching
    from ftctl.methods.adapters import AdapterMethod
    from ftctl.config.compose import compose_config
    from ftctl.models.packed_attention import use_packed_attention
    from ftctl.objectives.logprobs import sequence_loss
    from ftctl.precision.policy import PrecisionPolicy
    from ftctl.training.loss import returns_head_output

    cfg = compose_config(["recipe=tiny_dpo", f"model.name_or_path={tiny_model_dir}", "precision=fp32", "data.packing=true"])
    data = pair_data(tokenizer)
    indices = [5, 9, 2, 40]
    padded = PreferenceBatching(4, tokenizer.pad_token_id, 8)(data, indices)[0]
    packed = PreferenceBatching(4, tokenizer.pad_token_id, 8, pack_to=64)(data, indices)[0]
    assert packed.attention_mask is None and packed.input_ids.shape[0] < padded.input_ids.shape[0]
    reference = torch.linspace(-30, -10, padded.num_sequences)
    results = []
    for batch in (padded, packed):
        torch.manual_seed(0)
        model = AdapterMethod(cfg).build_model(str(tiny_model_dir), PrecisionPolicy("fp32", "cpu"), torch.device("cpu"))
        for name, param in model.named_parameters():
            if "lora_B" in name:
                torch.nn.init.normal_(param, std=0.05)
        use_packed_attention(model, "sdpa")
        returns_head_output(model.get_base_model())
        loss, logps = sequence_loss(model, batch, torch.device("cpu"), dpo_loss_fn(reference))
        loss.backward()
        results.append((loss.detach(), logps, {n: p.grad for n, p in model.named_parameters() if p.grad is not None}))
    (loss_a, logps_a, grads_a), (loss_b, logps_b, grads_b) = results
    torch.testing.assert_close(logps_b, logps_a, rtol=0, atol=1e-5)
    torch.testing.assert_close(loss_b, loss_a, rtol=0, atol=1e-5)
    for name in grads_a:
        torch.testing.assert_close(grads_b[name], grads_a[name], rtol=1e-4, atol=1e-5, msg=name)


# ----------------------------------------------------------------------------------------------
# the reference model and its cache


def test_disabled_adapter_reference_equals_a_separately_loaded_frozen_base(tiny_model_dir, tokenizer):
    from transformers import AutoModelForCausalLM

    from ftctl.config.compose import compose_config
    from ftctl.data.preference import PreferenceBatching
    from ftctl.methods.adapters import AdapterMethod
    from ftctl.objectives.logprobs import sequence_logps
    from ftctl.objectives.reference import DisabledAdapter
    from ftctl.precision.policy import PrecisionPolicy

    cfg = compose_config(["recipe=tiny_dpo", f"model.name_or_path={tiny_model_dir}", "precision=fp32", "method.dropout=0.1"])
    model = AdapterMethod(cfg).build_model(str(tiny_model_dir), PrecisionPolicy("fp32", "cpu"), torch.device("cpu"))
    for name, param in model.named_parameters():
        if "lora_B" in name:
            torch.nn.init.normal_(param, std=0.1)  # a trained adapter: switched on, it changes every score
    model.train()
    batch = PreferenceBatching(4, tokenizer.pad_token_id, 8)(pair_data(tokenizer), [0, 1, 2, 3])[0]
    cpu = torch.device("cpu")
    disabled = DisabledAdapter(model, model).sequence_logps(batch, cpu)
    assert model.training  # scoring leaves the training model's mode as it was
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        separate, adapted = sequence_logps(base, batch, cpu), sequence_logps(model.eval(), batch, cpu)
    torch.testing.assert_close(disabled, separate, rtol=0, atol=1e-6)
    assert (adapted - separate).abs().max() > 1e-2


def test_precomputed_reference_equals_on_the_fly_and_its_cache_hits_and_misses(dpo_cfg, run_training, tmp_path, caplog,
                                                                              tiny_model_dir):
    """Precomputed reference log-probs give the on-the-fly run's losses and gradient norms; a second run
    (and a resume) reads the cache without a pass; other data, or another base, misses it."""
    import ftctl.objectives.reference as reference

    passes = []
    real = reference.precompute_logps
    caplog.set_level(logging.INFO, logger="ftctl")

    def counted(ref, data, *args, **kwargs):
        passes.append((ref.kind, len(data)))
        return real(ref, data, *args, **kwargs)

    pytest.MonkeyPatch.setattr(pytest.MonkeyPatch(), reference, "precompute_logps", counted)
    try:
        for method in ("full", "lora"):
            live = run_training(dpo_cfg(f"method={method}", f"output_dir={tmp_path / method}-live"))[1]
            passes.clear()
            first = run_training(dpo_cfg(f"method={method}", "objective.precompute_reference=true", "train.save_every=1",
                                         f"output_dir={tmp_path / method}-pre"))[1]
            # Full fine-tuning scores with its own model before step 1 (no copy loaded); the LoRA run's reference is
            # the same base model in the same precision, so it reads what the full run cached.
            assert passes == ([("the training model before its first step", 64)] if method == "full" else [])
            for key in ("loss", "grad_norm", "rewards/margins"):
                for step, value in steps(live, key).items():
                    assert steps(first, key)[step] == pytest.approx(value, rel=1e-6, abs=1e-7), (method, key, step)
            if method == "full":
                full_first = first
        passes.clear()
        caplog.clear()
        second = run_training(dpo_cfg("method=full", "objective.precompute_reference=true", f"output_dir={tmp_path}/again"))[1]
        assert passes == [] and "reference log-probs of the train data: cache hit" in caplog.text
        assert steps(second) == steps(full_first)
        resumed = dpo_cfg("method=full", "objective.precompute_reference=true", f"output_dir={tmp_path}/resumed")
        resumed.resume = str(tmp_path / "full-pre" / "checkpoints" / "step-1")
        assert steps(run_training(resumed)[1]) == {2: steps(full_first)[2]} and passes == []
        # Other data: a miss, scored with the adapter switched off. Another base (other weights): a miss.
        fewer = write_jsonl(tmp_path / "fewer.jsonl", [json.loads(line) for line in PAIRS_FILE.read_text().splitlines()[:40]])
        run_training(dpo_cfg("objective.precompute_reference=true", f"data.path={fewer}", f"output_dir={tmp_path}/fewer"))
        assert passes == [("the training model with its adapter disabled", 40)]
        from ftctl.models.tiny import build_tiny_llama

        other_base = build_tiny_llama(tmp_path / "other_base", seed=1)
        passes.clear()
        run_training(dpo_cfg("objective.precompute_reference=true", f"output_dir={tmp_path}/other-base", model_dir=other_base))
        assert passes == [("the training model with its adapter disabled", 64)]
    finally:
        reference.precompute_logps = real


def test_an_existing_adapter_trains_on_against_a_frozen_copy(dpo_cfg, run_training, make_cfg, tmp_path, caplog):
    """model.adapter: DPO after SFT goes on training the SFT adapter; the reference is the SFT model, frozen."""
    sft, _ = run_training(make_cfg("train.max_steps=3", f"output_dir={tmp_path}/sft"))
    caplog.set_level(logging.INFO, logger="ftctl")
    result, metrics = run_training(dpo_cfg(f"model.adapter={sft.run_dir}", f"output_dir={tmp_path}/dpo"))
    assert "reference log-probs from a frozen copy of the starting model" in caplog.text
    assert steps(metrics)[1] == pytest.approx(math.log(2), abs=1e-6)  # the policy starts as its reference
    from safetensors.torch import load_file

    before, after = load_file(sft.final_dir / "adapter_model.safetensors"), load_file(result.final_dir / "adapter_model.safetensors")
    assert before.keys() == after.keys() and any(not torch.equal(before[k], after[k]) for k in before)


# ----------------------------------------------------------------------------------------------
# every objective with every method, precisions, the existing guarantees


@pytest.mark.parametrize("method", ["full", "lora", "qlora", "dora"])
@pytest.mark.parametrize("objective", ["dpo", "simpo", "orpo", "kto"])
def test_every_objective_trains_with_every_method(make_cfg, run_training, objective, method, tmp_path):
    data = "data=kto_sample" if objective == "kto" else "data=preference_sample"
    result, metrics = run_training(make_cfg(f"objective={objective}", data, f"method={method}", *SHORT, "data.eval_fraction=0.125",
                                            "data.packing=true"))
    trained = [m for m in metrics if "loss" in m]
    assert [m["step"] for m in trained] == [1, 2] and all(math.isfinite(m["loss"]) for m in trained)
    keys = set(REWARDS) | ({"kl"} if objective == "kto" else set())
    assert keys <= set(trained[-1]) and all(math.isfinite(trained[-1][k]) for k in keys)
    evaluated = next(m for m in metrics if "eval_loss" in m)
    assert math.isfinite(evaluated["eval_loss"]) and "eval_rewards/accuracies" in evaluated
    assert (result.final_dir / ("model.safetensors" if method == "full" else "adapter_model.safetensors")).is_file()
    if objective == "dpo" and method != "full":  # step 1 scores the untouched adapter: the policy is its reference
        assert trained[0]["loss"] == pytest.approx(math.log(2), abs=1e-6) and trained[0]["rewards/margins"] == 0


@pytest.mark.parametrize("precision", ["fp16", "bf16"])
@pytest.mark.parametrize("objective", ["dpo", "simpo", "orpo", "kto"])
def test_half_precisions_give_finite_rewards(make_cfg, run_training, objective, precision):
    """Log-probs and the loss stay fp32 under autocast; fp16 goes through the gradient scaler."""
    data = "data=kto_sample" if objective == "kto" else "data=preference_sample"
    _, metrics = run_training(make_cfg(f"objective={objective}", data, "method.dropout=0.0", *SHORT, f"precision={precision}",
                                       "method=full" if precision == "bf16" else "method=lora"))
    last = [m for m in metrics if "loss" in m][-1]
    assert all(math.isfinite(last[k]) for k in ("loss", "grad_norm", *REWARDS))
    assert ("loss_scale" in last) == (precision == "fp16")


def test_a_resumed_dpo_run_equals_an_uninterrupted_one(dpo_cfg, run_training, tmp_path):
    full, full_metrics = run_training(dpo_cfg("train.max_steps=4", "train.save_every=2", "method.dropout=0.1"))
    resumed = dpo_cfg("train.max_steps=4", "method.dropout=0.1", f"output_dir={tmp_path / 'resumed'}")
    resumed.resume = str(full.run_dir / "checkpoints" / "step-2")
    _, resumed_metrics = run_training(resumed)
    for key in ("loss", "grad_norm", "rewards/margins"):
        assert steps(resumed_metrics, key) == {s: v for s, v in steps(full_metrics, key).items() if s > 2}
    from safetensors.torch import load_file

    a = load_file(full.final_dir / "adapter_model.safetensors")
    b = load_file(tmp_path / "resumed" / "final" / "adapter_model.safetensors")
    assert all(torch.equal(a[k], b[k]) for k in a)


def test_the_nan_guard_stops_a_dpo_run_and_its_result_merges(dpo_cfg, run_training, tmp_path, monkeypatch):
    import ftctl.objectives.preference as preference
    from ftctl.training.interrupts import NonFiniteTraining

    real, calls = preference.sequence_loss, {"n": 0}

    def poisoned(module, batch, device, loss_fn):
        calls["n"] += 1
        loss, logps = real(module, batch, device, loss_fn)
        return (loss * float("nan"), logps) if calls["n"] > 2 * 2 else (loss, logps)  # 2 micro-batches a step: NaN in step 3

    monkeypatch.setattr(preference, "sequence_loss", poisoned)
    with pytest.raises(NonFiniteTraining, match=r"step 3: non-finite training.*saved in .*step-2"):
        run_training(dpo_cfg("train.max_steps=4"))
    kept = tmp_path / "run" / "checkpoints" / "step-2"
    assert main(["merge", f"adapter={kept}", f"output={tmp_path / 'merged'}"]) == 0
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(tmp_path / "merged")
    assert all(torch.isfinite(p).all() for p in merged.parameters())


# ----------------------------------------------------------------------------------------------
# data: formats, rendering, truncation, dropped pairs, preview


def test_every_pair_format_renders_the_same_sides(tmp_path, tokenizer):
    """TRL strings, conversational pairs, messages + final turns, Alpaca and ShareGPT with a ranking: the same
    pair gives the same two sequences; the trained tokens are the answer (and its end of turn) after the shared prompt."""
    q, good, bad = "Reverse the word: owl", "lwo", "owl"
    user, said = {"role": "user", "content": q}, lambda text: {"role": "assistant", "content": text}
    variants = {
        "preference": [{"prompt": q, "chosen": good, "rejected": bad},
                       {"chosen": [user, said(good)], "rejected": [user, said(bad)]},
                       {"messages": [user], "chosen": said(good), "rejected": bad},
                       {"prompt": [user], "chosen": [said(good)], "rejected": [said(bad)]}],
        "alpaca": [{"instruction": q, "chosen": good, "rejected": bad}, {"instruction": q, "output": [good, bad]}],
        "sharegpt": [{"conversations": [{"from": "human", "value": q}], "chosen": {"from": "gpt", "value": good},
                      "rejected": {"from": "gpt", "value": bad}}],
    }
    rendered = set()
    for data_format, rows in variants.items():
        data = pair_data(tokenizer, write_jsonl(tmp_path / f"{data_format}.jsonl", rows), data_format)
        for i in range(len(data)):
            (chosen_ids, chosen_labels), (rejected_ids, rejected_labels) = data[i]
            rendered.add((tuple(chosen_ids), tuple(chosen_labels), tuple(rejected_ids), tuple(rejected_labels)))
    assert len(rendered) == 1
    chosen_ids, chosen_labels, rejected_ids, rejected_labels = rendered.pop()
    start = next(i for i, label in enumerate(chosen_labels) if label != -100)
    assert chosen_ids[:start] == rejected_ids[:start]  # the shared prompt
    trained = lambda ids, labels: tokenizer.decode([t for t, label in zip(ids, labels) if label != -100])  # noqa: E731
    # The answer and its end-of-turn marker train (the template's generation block), nothing after it.
    assert trained(chosen_ids, chosen_labels) == "lwo<|im_end|>" and trained(rejected_ids, rejected_labels) == "owl<|im_end|>"
    assert tokenizer.decode(chosen_ids[:start]).endswith("<|im_start|>assistant\n")


def test_exactly_one_bos_with_a_template_that_writes_one(tmp_path):
    """A tokenizer that adds BOS and a template that writes it (data.chat_template=llama3): one BOS per side."""
    from tokenizers import Regex, Tokenizer, models, pre_tokenizers, processors
    from transformers import PreTrainedTokenizerFast

    words = ["<s>", "</s>", "<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>", "user", "assistant", "hi", "yes", "no", "\n", " "]
    backend = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="hi"))
    backend.pre_tokenizer = pre_tokenizers.Split(Regex(r"\n|\s+"), behavior="isolated")
    backend.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 0)])
    tok = PreTrainedTokenizerFast(tokenizer_object=backend, bos_token="<s>", eos_token="</s>", pad_token="</s>",
                                  additional_special_tokens=["<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>"])
    assert tok("hi")["input_ids"][0] == tok.bos_token_id  # the tokenizer itself adds one
    from ftctl.data.render import ensure_chat_template

    ensure_chat_template(tok, "llama3")
    data = pair_data(tok, write_jsonl(tmp_path / "p.jsonl", [{"prompt": "hi", "chosen": "yes", "rejected": "no"}]))
    for ids, _ in data[0]:
        assert list(ids).count(tok.bos_token_id) == 1 and ids[0] == tok.bos_token_id


def test_truncation_rule_share_and_dropped_pairs(tmp_path, tokenizer, dpo_cfg, run_training, caplog):
    long_answer = " ".join(["owl"] * 40)
    rows = [{"prompt": "Reverse the word: owl", "chosen": "lwo", "rejected": long_answer},
            {"prompt": "Reverse the word: cat", "chosen": "tac", "rejected": "tac"},
            {"prompt": "Reverse the word: dog", "chosen": "god", "rejected": "  "},
            {"prompt": "Reverse the word: yak", "chosen": "kay", "rejected": "yak"}]
    path = write_jsonl(tmp_path / "p.jsonl", rows)
    data = pair_data(tokenizer, path, max_seq_len=32)
    assert len(data) == 2 and data.stats["dropped_identical"] == 1 and data.stats["dropped_empty"] == 1
    assert data.truncated.tolist() == [True, False] and data.stats["truncated_share"] == 0.5
    (chosen_ids, chosen_labels), (rejected_ids, rejected_labels) = data[0]
    assert len(rejected_ids) == 32 and len(chosen_ids) < 32  # only the answer that is too long loses its tail
    start = next(i for i, label in enumerate(chosen_labels) if label != -100)
    assert start == next(i for i, label in enumerate(rejected_labels) if label != -100) > 0
    assert list(chosen_ids[:start]) == list(rejected_ids[:start])  # the prompt is kept whole, the answer loses its tail
    assert tokenizer.decode(rejected_ids[start:]) == tokenizer.decode(tokenizer(long_answer)["input_ids"][: 32 - start])
    caplog.set_level(logging.INFO, logger="ftctl")
    _, metrics = run_training(dpo_cfg(f"data.path={path}", "data.max_seq_len=32", "train.max_steps=1", "train.global_batch_size=2"))
    assert "dropped 1 pairs with identical answers and 1 with an empty answer" in caplog.text
    assert metrics[0]["truncated_share"] == 0.5


def test_kto_examples_get_kl_sequences_of_another_prompt(tokenizer):
    data = pair_data(tokenizer, KTO_FILE, "kto", kind="unpaired")
    assert len(data) == 64 and data.desirable.sum() == data.stats["desirable"] > 0
    for i in (0, 5):
        (ids, labels), (kl_ids, kl_labels) = data[i]
        start = next(k for k, label in enumerate(labels) if label != -100)
        kl_start = next(k for k, label in enumerate(kl_labels) if label != -100)
        partner = data[(i + 32) % 64][0]
        partner_start = next(k for k, label in enumerate(partner[1]) if label != -100)
        assert list(kl_ids[:kl_start]) == list(ids[:start]) and list(kl_ids[kl_start:]) == list(partner[0][partner_start:])


def test_preview_shows_both_sides_with_trained_tokens_marked(tiny_model_dir, capsys):
    assert main(["data", "preview", "recipe=tiny_dpo", f"model.name_or_path={tiny_model_dir}", "n=1"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("64 pairs from ") and "--- pair 0, chosen:" in out and "--- pair 0, rejected:" in out
    assert "\u27e6god<|im_end|>\u27e7" in out and "\u27e6dog<|im_end|>\u27e7" in out
    assert "Reverse the word: dog" in out.split("--- pair 0, chosen")[1].split("\u27e6")[0]  # the prompt is shown, unmarked


# ----------------------------------------------------------------------------------------------
# eval, the loss curve, bad inputs, config


def test_eval_scores_held_out_pairs_for_the_base_and_the_trained_model(dpo_cfg, run_training, tmp_path, capsys):
    result, metrics = run_training(dpo_cfg("train.max_steps=6", "train.lr=1e-2", "train.global_batch_size=8", "train.micro_batch_size=8",
                                           "train.tensorboard=true"))
    # The reward metrics reach the trackers too (TensorBoard here, read back with its own reader).
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from ftctl.training.trackers import metric_name

    events = EventAccumulator(str(result.run_dir / "tensorboard")).Reload()
    for key in ("rewards/margins", "rewards/accuracies", "logps/chosen", "truncated_share"):
        logged = [(e.step, pytest.approx(e.value, rel=1e-6)) for e in events.Scalars(metric_name(key))]
        assert logged == list(steps(metrics, key).items())
    assert main(["eval", f"adapter={result.run_dir}", f"data.path={PAIRS_FILE}", f"output={tmp_path}/eval", "n=24"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    summary = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert line.startswith("eval: preference accuracy base ") and summary["n"] == 24
    rows = [json.loads(r) for r in (tmp_path / "eval" / "predictions.jsonl").read_text().splitlines()]
    base_right = sum(r["base"]["chosen_logp"] > r["base"]["rejected_logp"] for r in rows)
    assert summary["base"]["accuracy"] == base_right / 24
    rewards = [0.1 * ((r["trained"]["chosen_logp"] - r["base"]["chosen_logp"]) - (r["trained"]["rejected_logp"] - r["base"]["rejected_logp"]))
               for r in rows]
    assert summary["reward"]["mean_margin"] == pytest.approx(sum(rewards) / 24)
    assert summary["reward"]["accuracy"] > 0.5 and summary["trained"]["mean_margin"] > summary["base"]["mean_margin"]


def test_the_loss_curve_draws_margins_and_accuracy():
    pytest.importorskip("matplotlib")
    from ftctl.training.plot import loss_figure

    rows = [{"step": s, "loss": 0.7 - 0.1 * s, "rewards/margins": 0.2 * s, "rewards/accuracies": 0.5 + 0.1 * s} for s in (1, 2, 3)]
    figure = loss_figure(rows + [{"step": 3, "eval_loss": 0.5, "eval_rewards/margins": 0.5, "eval_rewards/accuracies": 0.75}], "t")
    axes = figure.get_axes()
    assert len(axes) == 3 and axes[1].get_ylabel().startswith("reward margin") and axes[2].get_ylabel() == "reward accuracy"
    assert [line.get_label() for line in axes[2].get_lines()] == ["train reward accuracy", "held-out reward accuracy"]
    assert len(loss_figure([{"step": 1, "loss": 1.0}], "sft").get_axes()) == 1


BAD_INPUTS = {
    "missing_chosen": ([{"prompt": "Hi", "rejected": "no"}], "objective=dpo", "missing required field 'chosen'"),
    "identical_pair": ([{"prompt": "Hi", "chosen": "same", "rejected": "same"}], "objective=dpo",
                       "every pair was dropped (1 with identical answers, 0 with an empty answer)"),
    "long_prompt": ([{"prompt": "word " * 200, "chosen": "a", "rejected": "b"}], "objective=dpo",
                    "data.max_seq_len=64 leaves no room for an answer"),
    "kto_label": ([{"prompt": "Hi", "completion": "yes", "label": "true"}], "objective=kto",
                  "field 'label' must be true or false (JSON booleans), got 'true'"),
    "sft_file": ([{"instruction": "Hi", "output": "Hello"}], "objective=dpo",
                 "this is an SFT record (instruction, output), and a preference objective needs two answers"),
}


@pytest.mark.parametrize("case", sorted(BAD_INPUTS))
def test_bad_inputs_are_one_line_and_write_nothing(case, tmp_path, tiny_model_dir, capsys):
    rows, objective, message = BAD_INPUTS[case]
    path = write_jsonl(tmp_path / "data.jsonl", rows)
    data_format = {"kto_label": "kto", "sft_file": "alpaca"}.get(case, "preference")
    out = tmp_path / "run"
    code = main(["train", "recipe=tiny_dpo", f"model.name_or_path={tiny_model_dir}", objective, f"data.path={path}",
                 f"data.format={data_format}", "data.max_seq_len=64", f"output_dir={out}", "precision=fp32", "train.max_steps=1"])
    err = capsys.readouterr().err
    assert code == 1 and err.count("\n") == 1 and err.startswith("ftctl: error: ") and message in err, err
    assert not out.exists()
    if case != "long_prompt" and case != "identical_pair":
        assert f"{path}:1:" in err


@pytest.mark.parametrize("override, message", [
    (["method=dpo"], "method=dpo: dpo is an objective in ftctl, not a method: set objective=dpo"),
    (["objective=ipo"], "objective=ipo: ftctl's name for it is objective=dpo objective.loss_type=ipo"),
    (["objective=grpo"], "RL (PPO, GRPO, RLOO, reward models) is not supported"),
    (["objective=simpo", "objective.precompute_reference=true"], "objective=simpo has no reference model to precompute"),
    (["objective=dpo", "objective.loss_type=hinge", "objective.label_smoothing=0.1"], "applies to objective=dpo with loss_type sigmoid or robust"),
    (["objective=dpo", "data=alpaca_sample", "data.format=text"], "objective=dpo trains on preference data, which data.format=text does not hold"),
    (["data=preference_sample"], "data.format=preference holds preference data; train it with objective=dpo"),
    (["objective=kto", "data=kto_sample", "data.train_on_prompt=true"], "only answers train; set data.train_on_prompt=false"),
    (["model.adapter=runs/x", "method=full"], "model.adapter=runs/x goes on training an adapter"),
    (["pref_beta=0.2"], "ftctl's name for it: objective.beta."),
    (["objective=dpo", "data=preference_sample", "parallel=tp"], "objective=dpo does not run on parallel=mesh"),
])
def test_config_mistakes_are_one_line(override, message, capsys):
    code = main(["train", "recipe=tiny_lora", *override, "--cfg"])
    err = capsys.readouterr().err
    assert code == 2 and message in err and err.count("\n") == 1, err


def test_the_plan_names_the_objective_and_its_reference(tiny_model_dir, capsys):
    base = ["train", "--dry-run", "recipe=tiny_dpo", "precision=fp32"]
    assert main([*base, "method=full"]) == 0
    assert "  objective  dpo (sigmoid, beta 0.1; reference: a frozen copy of the starting model)" in capsys.readouterr().out
    assert main([*base, "objective=kto", "data=kto_sample", "objective.precompute_reference=true"]) == 0
    assert "  objective  kto (beta 0.1, weights 1/1; reference: precomputed once and cached)" in capsys.readouterr().out


def test_eval_reads_any_pair_format_and_checks_every_pair_before_loading_a_model(tmp_path, capsys):
    from ftctl.evaluation.evaluate import EvalRequest
    from ftctl.evaluation.preference import pair_format

    from ftctl.evaluation.preference import is_preference_eval

    ranked = write_jsonl(tmp_path / "ranked.jsonl", [{"instruction": "Hi", "chosen": "a", "rejected": "b"}])
    sft = write_jsonl(tmp_path / "sft.jsonl", [{"instruction": "Hi", "output": "a"}])
    assert is_preference_eval(str(ranked), "auto") and is_preference_eval(str(PAIRS_FILE), None)
    assert not is_preference_eval(str(sft), "auto") and not is_preference_eval(str(sft), "alpaca")
    assert pair_format(EvalRequest(str(ranked), "out")) == "alpaca"
    assert pair_format(EvalRequest(str(ranked), "out", data_format="auto")) == "alpaca"
    assert pair_format(EvalRequest(str(PAIRS_FILE), "out")) == "preference"
    with pytest.raises(FtctlError, match="a KTO file has one answer per prompt"):
        pair_format(EvalRequest(str(KTO_FILE), "out", data_format="kto"))
    broken = write_jsonl(tmp_path / "broken.jsonl", [{"prompt": "Hi", "chosen": "a", "rejected": "b"}, {"prompt": "Hi", "chosen": "a"}])
    assert main(["eval", "model=no-such-model", f"data.path={broken}", f"output={tmp_path}/eval"]) == 1
    err = capsys.readouterr().err
    assert f"{broken}:2: not a valid 'preference' record: missing required field 'rejected'" in err and "no-such-model" not in err


def test_format_auto_reads_preference_data_and_named_eval_sets_score_rewards(dpo_cfg, run_training, tmp_path, caplog):
    """data.format=auto picks the format that reads the first record as a pair (ranked Alpaca here, the
    preference file for the named eval set); each named set logs its loss and reward metrics."""
    rows = [json.loads(line) for line in PAIRS_FILE.read_text().splitlines()]
    ranked = write_jsonl(tmp_path / "ranked.jsonl", [{"instruction": r["prompt"], "chosen": r["chosen"], "rejected": r["rejected"]}
                                                     for r in rows])
    with caplog.at_level(logging.INFO, logger="ftctl"):
        _, metrics = run_training(dpo_cfg(f"data.path={ranked}", "data.format=auto", f"data.eval_sets={{held: {PAIRS_FILE}}}",
                                          "train.max_steps=1"))
    assert f"data.path={ranked}: alpaca (data.format=auto: its first record reads as pairs in it)" in caplog.text
    assert f"data.eval_sets.held.path={PAIRS_FILE}: preference (data.format=auto" in caplog.text
    evaluated = next(m for m in metrics if "eval/held_loss" in m)
    assert 0 < evaluated["eval/held_loss"] < math.log(2)  # after one step, the pairs it trained on are preferred a little
    assert 0 <= evaluated["eval/held_rewards/accuracies"] <= 1
    assert {"eval/held_rewards/accuracies", "eval/held_rewards/margins", "eval/held_truncated_share"} <= set(evaluated)


def test_format_auto_for_kto_and_max_record_bytes_skip_long_records(tmp_path, tokenizer, caplog):
    from ftctl.config.schema import DataConfig
    from ftctl.data.preference import UNPAIRED, load_or_tokenize_preference

    assert pair_data(tokenizer, KTO_FILE, "auto", UNPAIRED).stats["format"] == "kto"
    assert pair_data(tokenizer, PAIRS_FILE, "auto", UNPAIRED).stats["format"] == "preference"  # KTO reads pairs too
    rows = [{"prompt": "Hi", "chosen": "a", "rejected": "b"}, {"prompt": "Hi", "chosen": "x" * 500, "rejected": "b"},
            {"prompt": "Hey", "chosen": "c", "rejected": "d"}]
    path = write_jsonl(tmp_path / "pairs.jsonl", rows)
    cfg = DataConfig(format="auto", path=str(path), max_record_bytes=200, cache_dir=str(tmp_path / "cache"))
    with caplog.at_level(logging.WARNING, logger="ftctl"):
        data = load_or_tokenize_preference(str(path), cfg, tokenizer, "pairs")
    assert len(data) == 2 and data.stats["skipped_too_long"] == 1
    assert f"skipped 1 record longer than data.max_record_bytes=200 (the first: {path}:2" in caplog.text


@pytest.mark.slow
def test_dpo_raises_held_out_preference_accuracy_on_the_demo_task_by_30_points(make_cfg, run_training, tmp_path, capsys):
    """The preference demo's learning check at test size: the demo's 400 training pairs (correct JSON order
    against a plausible wrong one) and its 50 held-out pairs, on the tiny Llama instead of SmolLM2
    (`make demo-dpo` measures SmolLM2: 0.50 -> 1.00). Measured here: 0.50 -> 0.96 after 20 steps."""
    held_out = samples_dir() / "demo" / "orders_heldout.pairs.jsonl"
    result, _ = run_training(make_cfg("objective=dpo", "data=demo_orders_pairs", "method=full", "train.max_steps=20",
                                      "train.lr=2e-3", "train.global_batch_size=8", "train.micro_batch_size=8",
                                      "data.eval_fraction=0", "data.eval_path=null"))
    assert main(["eval", f"model={result.final_dir}", f"data.path={held_out}", f"output={tmp_path}/eval"]) == 0
    capsys.readouterr()
    summary = json.loads((tmp_path / "eval" / "eval.json").read_text())
    assert summary["n"] == 50
    assert summary["trained"]["accuracy"] - summary["base"]["accuracy"] >= 0.30, summary
