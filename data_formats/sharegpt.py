"""ShareGPT: ``conversations`` of ``{from, value}``; also OpenAI-style ``messages`` of ``{role, content}``.

A turn's text is a string, or OpenAI's list of content parts (its text parts are joined). An
assistant turn with ``"weight": 0`` (axolotl's convention) stays in the conversation as context
but is not trained.
"""

from __future__ import annotations

from data_formats import DataFormat, FormatError, register

SHAREGPT_ROLES = {"system": "system", "human": "user", "user": "user", "gpt": "assistant", "assistant": "assistant"}


@register
class ShareGPT(DataFormat):
    name = "sharegpt"
    signature_fields = ("conversations",)

    gives_pairs = True

    @classmethod
    def looks_like(cls, record):
        return "conversations" in record or "messages" in record

    def to_messages(self, record):
        if "conversations" in record:
            messages = parse_turns(record["conversations"], "conversations", ("from", "value"))
        elif "messages" in record:
            messages = parse_turns(record["messages"], "messages", ("role", "content"))
        else:
            raise FormatError("missing required field 'conversations' (or OpenAI-style 'messages')")
        if not any(m["role"] == "assistant" for m in messages):
            raise FormatError("the conversation has no assistant (gpt) turn to train on")
        return messages

    def to_pair(self, record):
        """``conversations`` (or ``messages``) up to the last user turn, plus ``chosen`` and ``rejected`` final turns:
        LLaMA-Factory's ranked ShareGPT."""
        from data_formats._preference import pair_after_conversation

        field = "conversations" if "conversations" in record else "messages"
        return pair_after_conversation(record, field)


def parse_turns(turns, field: str, keys=None):
    """ShareGPT turns (``from``/``value``) or OpenAI messages (``role``/``content``) as ftctl messages;
    ``keys`` = (role key, text key), or None to tell them by the first turn."""
    if not isinstance(turns, list) or not turns:
        raise FormatError(f"'{field}' must be a non-empty list of turns")
    if keys is None:
        keys = ("from", "value") if isinstance(turns[0], dict) and "from" in turns[0] else ("role", "content")
    role_key, text_key = keys
    messages = []
    for i, turn in enumerate(turns):
        if not isinstance(turn, dict) or role_key not in turn or text_key not in turn:
            raise FormatError(f"turn {i} must be an object with '{role_key}' and '{text_key}'")
        role = SHAREGPT_ROLES.get(str(turn[role_key]).lower())
        if role is None:
            raise FormatError(f"turn {i}: unknown speaker '{turn[role_key]}' (use system, human or gpt)")
        text = _text(turn[text_key], i, text_key)
        if role == "system" and i != 0:
            raise FormatError(f"turn {i}: a system message may only open the conversation")
        message = {"role": role, "content": text}
        if role == "assistant" and turn.get("weight", 1) == 0:
            message["train"] = False
        messages.append(message)
    return messages


def _text(content, i: int, text_key: str) -> str:
    if isinstance(content, str):
        return content
    if content is None:
        raise FormatError(f"turn {i}: '{text_key}' is null (a tool call?); ftctl trains on text turns only")
    if isinstance(content, list) and all(isinstance(part, dict) for part in content):
        kinds = {part.get("type") for part in content}
        if kinds - {"text"}:
            raise FormatError(f"turn {i}: content parts of type {', '.join(sorted(map(str, kinds - {'text'})))}; ftctl trains on text only")
        return "".join(str(part.get("text", "")) for part in content)
    raise FormatError(f"turn {i}: '{text_key}' must be a string (or a list of text parts)")
