"""Render a conversation with the tokenizer's chat template and mark which tokens are trained.

Every assistant turn after a prompt is trained together with the end-of-turn tokens the template
puts after it (EOS included); system and user turns, an assistant turn opening the conversation and
assistant turns marked untrained are masked with -100 unless ``train_on_prompt``.

Spans come from rendering prefixes: the tokens an assistant turn adds are those of the
conversation up to and including it, minus those of the conversation before it with the
generation prompt. This works for any template whose renderings extend each other, which is
checked, so a template that breaks the assumption is an error rather than silently wrong labels.
Where the renderings extend each other as text but not as tokens (a tokenizer merging characters
across a turn boundary), the text is cut at the turn boundaries and each piece tokenized alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional, Sequence, Tuple

IGNORE_INDEX = -100

#: Used when neither data.chat_template nor the tokenizer provides a template. Each assistant turn
#: ends in the tokenizer's EOS so a model trained with it learns to stop.
FALLBACK_CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ message['content'] + '\n\n' }}"
    "{% elif message['role'] == 'user' %}{{ '### User:\n' + message['content'] + '\n\n' }}"
    "{% elif message['role'] == 'assistant' %}{{ '### Assistant:\n' + message['content'] + eos_token + '\n\n' }}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '### Assistant:\n' }}{% endif %}"
)


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
    pieces = _turn_pieces(messages, lambda m, gen: _ids(tokenizer, m, gen))
    if pieces is None:
        # Tokenizers can merge across a turn boundary: "\n\n" ending a rendering is one token, the same
        # "\n\n" before "### User" two. Then the text is cut at the turn boundaries and each piece is
        # tokenized on its own (as LLaMA-Factory always does), provided the texts extend each other.
        texts = _turn_pieces(messages, lambda m, gen: _text(tokenizer, m, gen))
        if texts is None:
            raise TemplateError(
                "the chat template does not render conversations as extensions of their prefixes, so "
                "assistant spans cannot be located; set data.chat_template to a template that does"
            )
        pieces = [(tokenizer.encode(text, add_special_tokens=False), is_answer) for text, is_answer in texts]
    input_ids: List[int] = []
    labels: List[int] = []
    answer_part: List[int] = []
    for part, is_answer in pieces:
        part = list(part)
        input_ids += part
        labels += part if is_answer or train_on_prompt else [IGNORE_INDEX] * len(part)
        if is_answer:
            answer_part = part
    eos = tokenizer.eos_token_id
    if eos is not None and labels and eos not in answer_part:
        # Templates that close a turn without EOS would teach a model never to stop.
        input_ids.append(eos)
        labels.append(eos)
    truncated = len(input_ids) > max_seq_len
    return TokenizedExample(input_ids[:max_seq_len], labels[:max_seq_len], truncated)


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
