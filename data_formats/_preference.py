"""Readings of preference records that several formats share.

An answer may be given as text, as one assistant message (``{role, content}`` or ShareGPT's ``{from,
value}``) or as a list holding one assistant message; a prompt as text (one user turn) or as a list of
messages ending in a user turn. Earlier assistant turns of a prompt are context: they never train.
"""

from __future__ import annotations

from typing import Any, Dict, List

from data_formats import FormatError, LabelledAnswer, Message, PreferencePair, with_system_prompt
from data_formats.sharegpt import parse_turns


def prompt_messages(value: Any, field: str, system: str = "") -> List[Message]:
    """A prompt given as text or as messages, as messages ending in a user turn."""
    if isinstance(value, str):
        messages = [{"role": "user", "content": value}]
    elif isinstance(value, list):
        messages = parse_turns(value, field)
    elif value is None:
        raise FormatError(f"missing required field '{field}'")
    else:
        raise FormatError(f"field '{field}' must be a string or a list of messages, got {type(value).__name__}")
    if messages[-1]["role"] != "user":
        raise FormatError(f"'{field}' must end with a user turn (the answers follow it); it ends with a {messages[-1]['role']} turn")
    return as_context(with_system_prompt(messages, system))


def as_context(messages: List[Message]) -> List[Message]:
    """The prompt's assistant turns stay in the conversation, untrained: only the final answer trains."""
    return [{**m, "train": False} if m["role"] == "assistant" else m for m in messages]


def answer_text(record: Dict[str, Any], field: str) -> str:
    """The text of an answer field: a string, one assistant message, or a list holding one."""
    if field not in record or record[field] is None:
        raise FormatError(f"missing required field '{field}'")
    value = record[field]
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        value = [value]
    if isinstance(value, list):
        messages = parse_turns(value, field)
        if len(messages) != 1 or messages[0]["role"] != "assistant":
            raise FormatError(f"'{field}' must be one assistant turn (the prompt goes in its own field)")
        return messages[0]["content"]
    raise FormatError(f"field '{field}' must be a string or an assistant message, got {type(value).__name__}")


def pair_after_conversation(record: Dict[str, Any], field: str, system: str = "") -> PreferencePair:
    """``field`` holds the conversation up to the last user turn; ``chosen`` and ``rejected`` the two final answers."""
    refuse_sft_record(record)
    return PreferencePair(prompt_messages(record.get(field), field, system), answer_text(record, "chosen"),
                          answer_text(record, "rejected"))


def pair_from_conversations(record: Dict[str, Any]) -> PreferencePair:
    """``chosen`` and ``rejected`` as whole conversations that differ in their last (assistant) turn only."""
    chosen, rejected = parse_turns(record["chosen"], "chosen"), parse_turns(record["rejected"], "rejected")
    for name, messages in (("chosen", chosen), ("rejected", rejected)):
        if len(messages) < 2 or messages[-1]["role"] != "assistant":
            raise FormatError(f"'{name}' must be a conversation ending in the assistant's answer")
    if _plain(chosen[:-1]) != _plain(rejected[:-1]):
        raise FormatError("'chosen' and 'rejected' must share every turn but the last (the two answers)")
    prompt = chosen[:-1]
    if prompt[-1]["role"] != "user":
        raise FormatError(f"the answers must follow a user turn; they follow a {prompt[-1]['role']} turn")
    return PreferencePair(as_context(prompt), chosen[-1]["content"], rejected[-1]["content"])


def _plain(messages: List[Message]) -> List[tuple]:
    return [(m["role"], m["content"]) for m in messages]


def refuse_sft_record(record: Dict[str, Any]) -> None:
    """An SFT record where preference pairs are expected: say so in one line."""
    if "chosen" in record or "rejected" in record:
        return
    sft_fields = [f for f in ("instruction", "output", "conversations", "messages", "text") if f in record]
    if sft_fields:
        raise FormatError(
            f"missing required fields 'chosen' and 'rejected': this is an SFT record ({', '.join(sft_fields)}), and a "
            "preference objective needs two answers to each prompt (train it with objective=sft)"
        )


def label_value(record: Dict[str, Any], field: str = "label") -> bool:
    """KTO's label: JSON true or false, nothing that merely looks like one."""
    if field not in record:
        raise FormatError(f"missing required field '{field}'")
    value = record[field]
    if not isinstance(value, bool):
        raise FormatError(f"field '{field}' must be true or false (JSON booleans), got {value!r}")
    return value


def unpaired(record: Dict[str, Any], system: str = "") -> LabelledAnswer:
    """KTO's ``{prompt, completion, label}``."""
    return LabelledAnswer(prompt_messages(record.get("prompt"), "prompt", system), answer_text(record, "completion"),
                          label_value(record))
