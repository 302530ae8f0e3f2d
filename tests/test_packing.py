"""Throughput work that must not change what is trained: packing (data.packing) gives the same loss with
less padding, packed attention computes each example alone and matches the block-diagonal mask, the
chunked head loss gives the same loss and gradients without full logits, the CPU dropout of LoRA
layers draws the same masks' distribution with fewer random numbers, and the fused LoRA forward
computes what peft's does."""

from __future__ import annotations

import numpy as np
import pytest

from ftctl.data.batching import Batching, collate, pack_examples, pack_rows
from ftctl.data.render import IGNORE_INDEX


def _example(rng, n, prompt):
    ids = rng.integers(10, 500, n)
    labels = ids.copy()
    labels[:prompt] = IGNORE_INDEX
    return ids, labels


def test_pack_rows_uses_few_short_rows_and_never_splits():
    lengths = [50, 10, 70, 30, 40, 20, 100]
    rows = pack_rows(lengths, 100)
    assert sorted(i for row in rows for i in row) == list(range(len(lengths)))
    assert all(sum(lengths[i] for i in row) <= 100 for row in rows)
    assert len(rows) == 4  # 320 tokens need 4 rows of 100
    # Longest first, each dealt to the least-filled row: 100 | 70+10 | 50+20 | 40+30.
    assert rows == [[6], [1, 2], [0, 5], [3, 4]]
    # First fit alone would give 300+200 | 120+90 (width 500); balancing the two rows gives width 390.
    balanced = pack_rows([300, 120, 200, 90], 512)
    assert len(balanced) == 2 and max(sum([300, 120, 200, 90][i] for i in row) for row in balanced) == 390
    with pytest.raises(ValueError):
        pack_rows([101], 100)


def test_packed_layout_restarts_positions_and_keeps_trained_tokens():
    rng = np.random.default_rng(0)
    examples = [_example(rng, n, p) for n, p in ((30, 10), (12, 0), (25, 5), (40, 20))]
    padded = collate(examples, pad_token_id=0)
    packed = pack_examples(examples, row_len=64, pad_token_id=0)
    assert packed.attention_mask is None
    assert packed.trained_tokens == padded.trained_tokens
    assert packed.real_tokens == padded.real_tokens == 107
    assert packed.positions < padded.positions
    for r, row in enumerate(pack_rows([len(x) for x, _ in examples], 64)):
        start = 0
        for i in row:
            n = len(examples[i][0])
            assert packed.position_ids[r, start : start + n].tolist() == list(range(n))
            # The first token of a packed example is never predicted from the example before it.
            assert packed.labels[r, start] == IGNORE_INDEX
            start += n
        assert packed.position_ids[r, start:].tolist() == list(range(packed.input_ids.shape[1] - start))
        assert (packed.labels[r, start:] == IGNORE_INDEX).all()


def test_batching_keeps_micro_batch_count():
    """Packing lays out each micro-batch's examples differently; it never changes how many micro-batches a step has."""
    rng = np.random.default_rng(1)
    data = [_example(rng, int(n), 3) for n in rng.integers(5, 60, 16)]
    padded = Batching(4, 0, 8)(data, list(range(16)))
    packed = Batching(4, 0, 8, pack_to=128)(data, list(range(16)))
    assert len(padded) == len(packed) == 4
    assert [b.trained_tokens for b in padded] == [b.trained_tokens for b in packed]


@pytest.fixture(scope="module")
def tiny_model(tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    return AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa")


def test_packed_forward_has_no_attention_across_examples(tiny_model):
    """In a packed row, what another example says changes nothing; with positions that do not restart
    (the row read as one sequence) it would."""
    import dataclasses

    import torch

    from ftctl.training.loss import token_loss_sum

    rng = np.random.default_rng(2)
    scored = _example(rng, 24, 6)
    silent = np.full(20, IGNORE_INDEX)  # the neighbour trains nothing, so only `scored` adds to the loss
    neighbour, other_neighbour = (rng.integers(10, 500, 20), silent), (rng.integers(10, 500, 20), silent)
    cpu = torch.device("cpu")

    def loss(batch, restart=True):
        if not restart:
            width = batch.input_ids.shape[1]
            batch = dataclasses.replace(batch, position_ids=torch.arange(width).expand(batch.input_ids.shape).clone())
        with torch.no_grad():
            return token_loss_sum(tiny_model, batch, cpu)

    packed = pack_examples([neighbour, scored], 64, 0)
    other = pack_examples([other_neighbour, scored], 64, 0)
    assert packed.input_ids.shape[0] == 1  # both examples share one row
    torch.testing.assert_close(loss(packed), loss(other))
    torch.testing.assert_close(loss(packed), loss(collate([scored], 0)), rtol=1e-5, atol=1e-5)
    assert abs(float(loss(packed, restart=False)) - float(loss(other, restart=False))) > 1e-3


@pytest.mark.parametrize("wrap", ["plain", "peft"])
def test_chunked_head_loss_matches_full_logits(tiny_model_dir, wrap, monkeypatch):
    """The loss the head computes in chunks (only trained positions, no full logits) equals cross_entropy
    over full logits, in value and in gradients, for a plain HF model and a peft-wrapped one."""
    import torch
    from transformers import AutoModelForCausalLM

    import ftctl.training.loss as loss_module

    def build():
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
        if wrap == "peft":
            from peft import LoraConfig, get_peft_model

            model.requires_grad_(False)
            model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", init_lora_weights=False))
        return model

    monkeypatch.setattr(loss_module, "CHUNK_ELEMENTS", 7 * 512)  # several chunks even for this small batch
    rng = np.random.default_rng(3)
    batch = collate([_example(rng, n, p) for n, p in ((30, 10), (17, 3), (26, 26 - 4))], 0)
    results = []
    for fused in (True, False):
        model = build()
        if fused:
            assert loss_module.head_for_loss(model) is not None
        else:
            monkeypatch.setattr(loss_module, "head_for_loss", lambda module: None)
        loss = loss_module.token_loss_sum(model, batch, torch.device("cpu"))
        (loss * 0.25).backward()
        grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad}
        results.append((loss.detach(), grads))
        # The head is itself again after the call.
        assert "forward" not in model.get_output_embeddings().__dict__
    (fused_loss, fused_grads), (plain_loss, plain_grads) = results
    torch.testing.assert_close(fused_loss, plain_loss, rtol=1e-5, atol=1e-4)
    assert fused_grads.keys() == plain_grads.keys() and fused_grads
    for name in plain_grads:
        torch.testing.assert_close(fused_grads[name], plain_grads[name], rtol=1e-4, atol=1e-6, msg=name)


def test_packed_run_trains_like_unpacked_with_less_padding(make_cfg, run_training):
    """Same examples per step, same loss every step; the padding share drops and is reported."""
    common = ("train.max_steps=4", "train.micro_batch_size=4", "train.global_batch_size=8", "data.max_seq_len=128")
    _, padded = run_training(make_cfg(*common, "data.packing=false"))
    _, packed = run_training(make_cfg(*common, "data.packing=true", "overwrite=true"))
    padded = [m for m in padded if "loss" in m]
    packed = [m for m in packed if "loss" in m]
    assert len(padded) == len(packed) == 4
    for a, b in zip(padded, packed):
        assert a["trained_tokens"] == b["trained_tokens"]
        assert b["loss"] == pytest.approx(a["loss"], rel=1e-4)
        assert 0.0 <= b["padding_waste"] < a["padding_waste"] < 1.0
        assert a["non_trained_share"] > a["padding_waste"]  # prompts are untrained too
        assert b["trained_tokens_per_s"] > 0


def test_bits_dropout_is_dropout_with_a_byte_mask():
    import torch

    from ftctl.methods.dropout import BitsDropout, use_bits_dropout

    torch.manual_seed(0)
    dropout = BitsDropout(0.1).train()
    x = torch.randn(512, 1024, requires_grad=True)
    y = dropout(x)
    kept = y != 0
    assert float(kept.float().mean()) == pytest.approx(0.9, abs=0.003)  # 524k draws: 4 standard deviations
    torch.testing.assert_close(y[kept], x[kept] / 0.9)
    y.backward(torch.ones_like(y))
    torch.testing.assert_close(x.grad, kept.float() / 0.9)
    assert not torch.equal(kept, dropout(x) != 0)  # a fresh mask every call
    torch.manual_seed(1)
    first = dropout(x)
    torch.manual_seed(1)
    assert torch.equal(first, dropout(x))  # seeded like the rest of the run
    assert dropout.eval()(x) is x and BitsDropout(0.0).train()(x) is x
    # What autograd keeps for backward: a 1-byte mask, where nn.Dropout keeps fp32 noise.
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        BitsDropout(0.1).train()(x)
    assert [t.dtype for t in saved] == [torch.uint8]

    from peft import LoraConfig, get_peft_model
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1)
    model = get_peft_model(LlamaForCausalLM(config), LoraConfig(r=2, lora_dropout=0.05, target_modules="all-linear"))
    assert use_bits_dropout(model) == 7
    assert all(isinstance(d, BitsDropout) for m in model.modules() if hasattr(m, "lora_dropout") for d in m.lora_dropout.values())


def _packed_batch(seed=4):
    rng = np.random.default_rng(seed)
    examples = [_example(rng, n, p) for n, p in ((30, 10), (17, 3), (45, 20), (9, 2), (22, 5))]
    batch = pack_examples(examples, row_len=64, pad_token_id=0)
    assert batch.input_ids.shape[0] == 2 and batch.positions > batch.real_tokens  # two rows, padded tails
    return batch


def test_packed_attention_matches_the_block_diagonal_mask(tiny_model_dir, monkeypatch):
    """Per-example causal SDPA (one call per example and per padded tail) gives the loss and the
    gradients of the block-diagonal mask over whole rows, on a model with grouped-query attention."""
    import torch
    import torch.nn.functional as F
    from transformers import AutoModelForCausalLM

    from ftctl.models import packed_attention
    from ftctl.training.loss import returns_head_output, token_loss_sum

    batch = _packed_batch()
    spans = len(batch.cu_seq_lens) - 1
    assert batch.cu_seq_lens[-1] == batch.input_ids.numel() and spans == 7  # 5 examples + 2 tails
    calls = []
    real_sdpa = F.scaled_dot_product_attention
    monkeypatch.setattr(packed_attention.F, "scaled_dot_product_attention",
                        lambda *a, **k: calls.append(k) or real_sdpa(*a, **k))
    results = []
    for packed in (False, True):
        calls.clear()
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa")
        assert model.config.num_key_value_heads < model.config.num_attention_heads
        if packed:
            assert packed_attention.use_packed_attention(model)
        returns_head_output(model)  # its one-off probe forward is not counted below
        calls.clear()
        loss = token_loss_sum(model, batch, torch.device("cpu"))
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters()}))
    assert len(calls) == spans * model.config.num_hidden_layers
    assert all(k["is_causal"] and k["enable_gqa"] and "attn_mask" not in k for k in calls)
    (masked_loss, masked_grads), (packed_loss, packed_grads) = results
    torch.testing.assert_close(packed_loss, masked_loss, rtol=1e-5, atol=1e-5)
    for name, grad in masked_grads.items():
        torch.testing.assert_close(packed_grads[name], grad, rtol=1e-4, atol=1e-5, msg=name)
    # Padded batches (no boundaries) still take the masked SDPA path.
    calls.clear()
    rng = np.random.default_rng(5)
    padded = collate([_example(rng, n, 2) for n in (12, 20)], 0)
    with torch.no_grad():
        token_loss_sum(model, padded, torch.device("cpu"))
    assert len(calls) == model.config.num_hidden_layers and all(k["attn_mask"] is not None for k in calls)


def test_packed_attention_rejects_boundaries_that_cross_rows():
    import torch

    from ftctl.models.packed_attention import example_spans

    assert example_spans(torch.tensor([0, 3, 8, 10, 16]), rows=2, row_len=8) == [(0, 0, 3), (0, 3, 8), (1, 0, 2), (1, 2, 8)]
    with pytest.raises(ValueError, match="spans rows"):
        example_spans(torch.tensor([0, 6, 12, 16]), rows=2, row_len=8)
    with pytest.raises(ValueError, match="do not cover"):
        example_spans(torch.tensor([0, 6, 8]), rows=2, row_len=8)


def test_packed_attention_is_only_swapped_in_for_sdpa(tiny_model_dir):
    import torch
    from transformers import AutoModelForCausalLM

    from ftctl.models.packed_attention import PACKED_SDPA, use_packed_attention

    eager = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="eager")
    assert not use_packed_attention(eager) and eager.config._attn_implementation == "eager"
    sdpa = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32, attn_implementation="sdpa")
    assert use_packed_attention(sdpa) and sdpa.config._attn_implementation == PACKED_SDPA


def _lora_model(tiny_model_dir, dropout, fused):
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from ftctl.methods.dropout import use_bits_dropout
    from ftctl.methods.fused_lora import use_fused_lora_forward

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    model.requires_grad_(False)
    config = LoraConfig(r=4, lora_alpha=8, lora_dropout=dropout, target_modules="all-linear", init_lora_weights=False)
    model = get_peft_model(model, config)
    use_bits_dropout(model)
    if fused:
        assert use_fused_lora_forward(model) == 7 * model.config.num_hidden_layers
    return model


@pytest.mark.parametrize("dropout", [0.0, 0.1])
def test_fused_lora_forward_computes_what_peft_does(tiny_model_dir, dropout):
    """Same outputs and adapter gradients as peft's forward, dropout masks included (same random draws)."""
    import torch

    from ftctl.training.loss import token_loss_sum

    batch = _packed_batch()
    results = []
    for fused in (False, True):
        model = _lora_model(tiny_model_dir, dropout, fused).train()
        torch.manual_seed(1)
        loss = token_loss_sum(model, batch, torch.device("cpu"))
        loss.backward()
        results.append((loss.detach(), {n: p.grad for n, p in model.named_parameters() if p.requires_grad}))
    (peft_loss, peft_grads), (fused_loss, fused_grads) = results
    torch.testing.assert_close(fused_loss, peft_loss, rtol=1e-5, atol=1e-5)
    assert peft_grads.keys() == fused_grads.keys() and len(peft_grads) == 2 * 7 * 2
    for name, grad in peft_grads.items():
        torch.testing.assert_close(fused_grads[name], grad, rtol=1e-4, atol=1e-5 * float(grad.abs().max()), msg=name)


def test_fused_lora_forward_defers_to_peft_outside_the_plain_state(tiny_model_dir):
    """Disabled or merged adapters take peft's own forward; a dropped input is rebuilt in backward, not kept."""
    import torch
    from transformers import AutoModelForCausalLM

    model = _lora_model(tiny_model_dir, 0.1, fused=True)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ids = torch.randint(3, 500, (2, 16))
    model.eval()
    with torch.no_grad():
        adapted = model(input_ids=ids).logits
        with model.disable_adapter():
            torch.testing.assert_close(model(input_ids=ids).logits, base(input_ids=ids).logits)
        model.merge_adapter()
        torch.testing.assert_close(model(input_ids=ids).logits, adapted, rtol=1e-4, atol=1e-5)
        model.unmerge_adapter()
        torch.testing.assert_close(model(input_ids=ids).logits, adapted)
    assert not torch.allclose(adapted, base(input_ids=ids).logits)

    layer = model.get_base_model().model.layers[1].self_attn.q_proj
    layer.train()
    x = torch.randn(2, 16, layer.in_features, requires_grad=True)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        layer(x)
    def is_x(t):  # x itself or a reshaped view of it
        return t.untyped_storage().data_ptr() == x.untyped_storage().data_ptr() and t.numel() == x.numel()

    assert any(is_x(t) for t in saved) and torch.int16 in {t.dtype for t in saved}
    assert not any(t.numel() == x.numel() and t.dtype == torch.float32 and not is_x(t) for t in saved)
