"""Render a conversation with the tokenizer's chat template and mark which tokens are trained.

Every assistant turn is trained together with the end-of-turn tokens the template puts after it
(EOS included); system and user turns are masked with -100 unless ``train_on_prompt``.

Spans come from rendering prefixes: the tokens an assistant turn adds are those of the
conversation up to and including it, minus those of the conversation before it with the
generation prompt. This works for any template whose renderings extend each other, which is
checked, so a template that breaks the assumption is an error rather than silently wrong labels.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

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
    """Install the template the run uses on the tokenizer (it is saved with the result) and return it."""
    if override:
        tokenizer.chat_template = override
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


def tokenize_conversation(
    messages: List[Dict[str, str]], tokenizer, max_seq_len: int, train_on_prompt: bool = False
) -> TokenizedExample:
    input_ids: List[int] = []
    labels: List[int] = []
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        prompt = _ids(tokenizer, messages[:i], add_generation_prompt=True)
        full = _ids(tokenizer, messages[: i + 1], add_generation_prompt=False)
        if full[: len(input_ids)] != input_ids or prompt[: len(input_ids)] != input_ids or full[: len(prompt)] != prompt:
            raise TemplateError(
                "the chat template does not render conversations as extensions of their prefixes, so "
                "assistant spans cannot be located; set data.chat_template to a template that does"
            )
        prompt_part, answer_part = prompt[len(input_ids):], full[len(prompt):]
        input_ids += prompt_part + answer_part
        labels += (prompt_part if train_on_prompt else [IGNORE_INDEX] * len(prompt_part)) + answer_part
    eos = tokenizer.eos_token_id
    if eos is not None and labels and eos not in answer_part:
        # Templates that close a turn without EOS would teach a model never to stop.
        input_ids.append(eos)
        labels.append(eos)
    truncated = len(input_ids) > max_seq_len
    return TokenizedExample(input_ids[:max_seq_len], labels[:max_seq_len], truncated)
