"""Batched generation from chat messages (greedy unless a temperature is given), shared by `ftctl eval`, `chat` and `generate`.

Prompts are rendered with the tokenizer's chat template and the generation prompt, exactly as the
training renderer builds the prompt part of an example, then left-padded so that every row's next
token sits in the last column.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Dict, List, Optional, Sequence

import torch

from ftctl.data.render import end_of_turn_ids
from ftctl.progress import progress_bar

Messages = List[Dict[str, str]]


def prompt_ids(tokenizer, messages: Messages) -> List[int]:
    out = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True, return_dict=False)
    if hasattr(out, "get") and not isinstance(out, list):  # a BatchEncoding in some versions
        out = out["input_ids"]
    return list(out)


def left_pad(rows: Sequence[Sequence[int]], pad_id: int):
    """(input_ids, attention_mask) with every row right-aligned."""
    width = max(len(r) for r in rows)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if row:
            ids[i, width - len(row):] = torch.tensor(row, dtype=torch.long)
            mask[i, width - len(row):] = 1
    return ids, mask


def answer_stops(model, tokenizer) -> List[int]:
    """Where an answer ends: EOS, the model's own end tokens (its generation_config) and the chat template's
    end-of-turn marker, so a model that writes ``<|eot_id|>`` without EOS after it stops there."""
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    configured = configured if isinstance(configured, (list, tuple)) else [configured]
    stops = [tokenizer.eos_token_id, *configured, *end_of_turn_ids(tokenizer)]
    return list(dict.fromkeys(t for t in stops if t is not None))


@contextmanager
def _seeded(seed: Optional[int], device: torch.device):
    """Sampling draws from a generator seeded here, leaving the caller's random state as it was."""
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        yield


@torch.no_grad()
def generate(
    model,
    tokenizer,
    messages_list: Sequence[Messages],
    max_new_tokens: int = 64,
    *,
    batch_size: int = 16,
    stop_token_ids: Sequence[int] | None = None,
    temperature: float = 0.0,
    top_p: float = 1.0,
    seed: Optional[int] = None,
    progress: Optional[str] = None,
) -> List[str]:
    """Completions of each conversation's next assistant turn, in input order.

    Greedy when ``temperature`` is 0; otherwise sampled at that temperature from the ``top_p``
    nucleus, reproducibly for a given ``seed``. Conversations are batched by prompt length (less
    padding); each completion stops at its end of turn (:func:`answer_stops`, or any of ``stop_token_ids``) and is decoded without
    special tokens. ``progress`` names a progress bar over the conversations (none when None).
    """
    if not messages_list:
        return []
    prompts = [prompt_ids(tokenizer, m) for m in messages_list]
    pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    stops = list(stop_token_ids) if stop_token_ids else answer_stops(model, tokenizer)
    device = next(model.parameters()).device
    was_training = model.training
    model.eval()
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    outputs: List[str] = [""] * len(prompts)
    if temperature > 0:
        # top_k=0 turns off the model's default top-k so only top_p trims the distribution.
        decoding = {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": 0}
    else:
        # Greedy must not inherit sampling settings from the model's generation_config.
        decoding = {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
    bar = progress_bar(len(prompts), progress, unit="ex") if progress else None
    try:
        with _seeded(seed if temperature > 0 else None, device):
            for start in range(0, len(order), batch_size):
                chunk = order[start:start + batch_size]
                ids, mask = left_pad([prompts[i] for i in chunk], pad_id)
                generated = model.generate(
                    input_ids=ids.to(device),
                    attention_mask=mask.to(device),
                    max_new_tokens=max_new_tokens,
                    num_beams=1,
                    eos_token_id=stops,
                    pad_token_id=pad_id,
                    **decoding,
                )
                for row, i in enumerate(chunk):
                    new_tokens = generated[row, ids.shape[1]:].tolist()
                    cut = next((k for k, t in enumerate(new_tokens) if t in stops), len(new_tokens))
                    outputs[i] = tokenizer.decode(new_tokens[:cut], skip_special_tokens=True)
                if bar is not None:
                    bar.update(len(chunk))
    finally:
        if bar is not None:
            bar.close()
        model.train(was_training)
    return outputs
