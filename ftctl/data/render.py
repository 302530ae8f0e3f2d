"""Render a conversation with the tokenizer's chat template and mark which tokens are trained.

Every assistant turn after a prompt is trained, its end-of-turn token included; system and user
turns, an assistant turn opening the conversation and assistant turns marked untrained are masked
with -100 unless ``train_on_prompt``.

Turns come from rendering prefixes: the tokens an assistant turn adds are those of the
conversation up to and including it, minus those of the conversation before it with the
generation prompt. This works for any template whose renderings extend each other, which is
checked, so a template that breaks the assumption is an error rather than silently wrong labels.
Where the renderings extend each other as text but not as tokens (a tokenizer merging characters
across a turn boundary), the text is cut at the turn boundaries and each piece tokenized alone.

Within an answer's tokens, exactly those its template's ``{% generation %}`` block covers are
trained (the tokens transformers' ``return_assistant_tokens_mask`` marks): the answer and its
end-of-turn marker, not the newline a template writes after it. A template without the block
(many tokenizers' own) trains the answer up to its last special token; whitespace after that
belongs to the next turn.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

IGNORE_INDEX = -100

#: Used when neither data.chat_template nor the tokenizer provides a template. Each assistant turn
#: ends in the tokenizer's EOS so a model trained with it learns to stop.
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] + '\n\n' }}"
    "{% elif message['role'] == 'user' %}{{ '### User:\n' + message['content'] + '\n\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ '### Assistant:\n' }}"
    "{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}{{ '\n\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '### Assistant:\n' }}{% endif %}"
)
_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")


class TemplateError(ValueError):
    pass


@dataclass
class TokenizedExample:
    input_ids: List[int]
    labels: List[int]
    truncated: bool

    @property
    def trained_tokens(self) -> int:
        return sum(1 for label in self.labels if label != IGNORE_INDEX)


def ensure_chat_template(tokenizer, override: Optional[str] = None) -> str:
    """Install the template the run uses on the tokenizer (it is saved with the result) and return it.
    ``override`` is a data.chat_template value: a template's name, Jinja text or a .jinja file."""
    if override:
        from ftctl.data.chat_templates import resolve_chat_template

        tokenizer.chat_template = resolve_chat_template(override)
    elif not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = FALLBACK_CHAT_TEMPLATE
    return tokenizer.chat_template


def _ids(tokenizer, messages, add_generation_prompt: bool) -> List[int]:
    if not messages:
        return []
    out = tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=add_generation_prompt, return_dict=False
    )
    if hasattr(out, "get") and not isinstance(out, list):  # a BatchEncoding in some versions
        out = out["input_ids"]
    return list(out)


def _text(tokenizer, messages, add_generation_prompt: bool) -> str:
    if not messages:
        return ""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def end_of_turn_ids(tokenizer) -> List[int]:
    """The special tokens the chat template writes right after an assistant's answer (``<|im_end|>``,
    ``<|eot_id|>``, ``<end_of_turn>``, EOS): where a generated answer ends. Empty when the template
    does not render a probe conversation as prompt + answer."""
    probe = [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello"}]
    try:
        prompt, full = _ids(tokenizer, probe[:1], True), _ids(tokenizer, probe, False)
    except Exception:  # a template that needs other roles or keys: no stops beyond EOS
        return []
    if full[:len(prompt)] != prompt:
        return []
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    answer = full[len(prompt):]
    first_text = next((k for k, token in enumerate(answer) if token not in special), len(answer))
    return list(dict.fromkeys(token for token in answer[first_text:] if token in special))


def trains(message: Dict[str, str], before: List[Dict[str, str]]) -> bool:
    """Whether a turn is an answer to train: an assistant turn after some prompt (a user or system turn),
    not marked ``train: False`` (a ShareGPT turn with weight 0). An assistant turn opening the
    conversation answers nobody; it stays as context, and its role header (which has no prompt to come
    after) is never a target."""
    return message["role"] == "assistant" and message.get("train", True) and bool(before)


def _turn_pieces(messages: List[Dict[str, str]], render) -> Optional[List[Tuple[Sequence, bool]]]:
    """The conversation cut at its assistant turns: (piece, is_answer) pairs, each piece what one rendering
    (a list of token ids, or text) adds to the one before; None when a rendering does not extend the one before."""
    pieces: List[Tuple[Sequence, bool]] = []
    done = render([], False)
    for i, message in enumerate(messages):
        if not trains(message, messages[:i]):
            continue
        prompt = render(messages[:i], True)
        full = render(messages[: i + 1], False)
        if full[: len(done)] != done or prompt[: len(done)] != done or full[: len(prompt)] != prompt:
            return None
        pieces += [(prompt[len(done):], False), (full[len(prompt):], True)]
        done = full
    return pieces


def tokenize_conversation(
    messages: List[Dict[str, str]], tokenizer, max_seq_len: int, train_on_prompt: bool = False
) -> TokenizedExample:
    marked = generation_spans(tokenizer, messages)
    pieces = _turn_pieces(messages, lambda m, gen: _ids(tokenizer, m, gen))
    tokens = _mark_token_pieces(pieces, tokenizer, marked) if pieces is not None else None
    if tokens is None:
        # Tokenizers can merge across a turn boundary: "\n\n" ending a rendering is one token, the same
        # "\n\n" before "### User" two. Then the text is cut at the turn boundaries and each piece is
        # tokenized on its own (as LLaMA-Factory always does), provided the texts extend each other.
        texts = _turn_pieces(messages, lambda m, gen: _text(tokenizer, m, gen))
        if texts is None:
            raise TemplateError(
                "the chat template does not render conversations as extensions of their prefixes, so "
                "assistant spans cannot be located; set data.chat_template to a template that does"
            )
        tokens = _mark_text_pieces(texts, tokenizer, marked)
    input_ids: List[int] = []
    labels: List[int] = []
    last_answer: List[int] = []
    end = 0  # just after the last answer's last trained token: what its template writes after that precedes nothing to learn
    for part, trained, is_answer in tokens:
        labels += [token if is_trained or train_on_prompt else IGNORE_INDEX for token, is_trained in zip(part, trained)]
        end = max([end] + [len(input_ids) + k + 1 for k, is_trained in enumerate(trained) if is_trained])
        input_ids += part
        if is_answer:
            last_answer = [token for token, is_trained in zip(part, trained) if is_trained]
    input_ids, labels = input_ids[:end], labels[:end]
    eos = tokenizer.eos_token_id
    if eos is not None and last_answer and eos not in last_answer:
        # Templates that close a turn without EOS would teach a model never to stop: it follows the end of turn.
        input_ids.append(eos)
        labels.append(eos)
    truncated = len(input_ids) > max_seq_len
    return TokenizedExample(input_ids[:max_seq_len], labels[:max_seq_len], truncated)


Spans = List[Tuple[int, int]]
#: Token pieces with, per token, whether it trains, and whether the piece is an answer.
MarkedPieces = List[Tuple[List[int], List[bool], bool]]


def generation_spans(tokenizer, messages: List[Dict[str, str]]) -> Optional[Tuple[str, Spans]]:
    """(the conversation's rendering, the character spans of its template's ``{% generation %}`` blocks),
    or None when the template has no such block. transformers' ``return_assistant_tokens_mask`` marks
    the tokens that overlap these spans."""
    template = getattr(tokenizer, "chat_template", None)
    if not isinstance(template, str) or not _GENERATION_TAG.search(template) or not messages:
        return None
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, indices = render_jinja_template(conversations=[messages], chat_template=template,
                                              return_assistant_tokens_mask=True, **tokenizer.special_tokens_map)
    return rendered[0], [tuple(span) for span in indices[0]]


def _overlaps(start: int, end: int, spans: Spans) -> bool:
    return any(end > a and start < b for a, b in spans)


def _mark_token_pieces(pieces, tokenizer, marked) -> Optional[MarkedPieces]:
    """Each token-level piece with its trained tokens; None when the rendering's offsets cannot be matched to
    the pieces' tokens (a slow tokenizer, or tokens that differ), which the text path then handles."""
    if marked is None:
        return [(list(part), _up_to_turn_end(part, tokenizer) if is_answer else [False] * len(part), is_answer)
                for part, is_answer in pieces]
    text, spans = marked
    ids = [token for part, _ in pieces for token in part]
    try:
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    except (NotImplementedError, ValueError, TypeError):
        return None
    if list(encoded["input_ids"][: len(ids)]) != ids:
        return None
    offsets, out, position = encoded["offset_mapping"], [], 0
    for part, is_answer in pieces:
        trained = [is_answer and _overlaps(*offsets[k], spans) for k in range(position, position + len(part))]
        out.append((list(part), trained, is_answer))
        position += len(part)
    return out


def _mark_text_pieces(texts, tokenizer, marked) -> MarkedPieces:
    """Each text piece tokenized alone; an answer's text is cut where its generation block starts and ends."""
    if marked is not None and not marked[0].startswith("".join(text for text, _ in texts)):
        marked = None
    out: MarkedPieces = []
    start = 0
    for text, is_answer in texts:
        end = start + len(text)
        if not is_answer:
            cuts = [(text, False)]
        elif marked is None:
            part = tokenizer.encode(text, add_special_tokens=False)
            out.append((part, _up_to_turn_end(part, tokenizer), True))
            start = end
            continue
        else:
            bounds = sorted({start, end, *(max(start, min(end, b)) for span in marked[1] for b in span)})
            cuts = [(text[a - start:b - start], _overlaps(a, b, marked[1])) for a, b in zip(bounds, bounds[1:])]
        for piece, trained in cuts:
            part = tokenizer.encode(piece, add_special_tokens=False) if piece else []
            out.append((part, [trained] * len(part), is_answer))
        start = end
    return out


def _up_to_turn_end(part: Sequence[int], tokenizer) -> List[bool]:
    """An answer of a template without ``{% generation %}``: trained up to its last special token (its end of
    turn) when only whitespace follows, which belongs to the next turn; else trained whole."""
    special = set(tokenizer.all_special_ids) | {i for i, t in tokenizer.added_tokens_decoder.items() if t.special}
    last = max((k for k, token in enumerate(part) if token in special), default=None)
    if last is None or tokenizer.decode(list(part[last + 1:])).strip():
        return [True] * len(part)
    return [k <= last for k in range(len(part))]


def tokenize_text(text: str, tokenizer, max_seq_len: int) -> List[TokenizedExample]:
    """A document for continued pretraining: every token trained, EOS appended, split into examples of at most
    ``max_seq_len`` tokens, so nothing of a long document is cut off."""
    ids = list(tokenizer(text, add_special_tokens=True)["input_ids"])
    if tokenizer.eos_token_id is not None and (not ids or ids[-1] != tokenizer.eos_token_id):
        ids.append(tokenizer.eos_token_id)
    # Consecutive pieces share one token: a piece's first token is never a target (nothing precedes it),
    # so it is the previous piece's last, and every token of the document after its first is trained once.
    stride = max_seq_len - 1
    pieces = [ids[start : start + max_seq_len] for start in range(0, max(len(ids) - 1, 1), stride)]
    return [TokenizedExample(piece, list(piece), False) for piece in pieces if len(piece) > 1]
