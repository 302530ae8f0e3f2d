"""Plain text for continued pretraining: a ``text`` field, every token trained, EOS appended.

No chat template and no prompt: the document is tokenized as it is (with the tokenizer's BOS when it
adds one) and ends in EOS, so documents stay apart. A document longer than ``data.max_seq_len`` is
split into consecutive examples of that length rather than truncated, so none of it is lost.
"""

from __future__ import annotations

from data_formats import DataFormat, FormatError, register, require_text


@register
class Text(DataFormat):
    name = "text"
    signature_fields = ("text",)
    plain_text = True

    def to_text(self, record) -> str:
        text = require_text(record, "text")
        if not text.strip():
            raise FormatError("field 'text' is empty")
        return text

    def to_messages(self, record):
        raise FormatError("a text record has no prompt and answer; chat and eval need a chat format (alpaca, sharegpt, openai)")

    @classmethod
    def looks_like(cls, record):
        return set(record) == {"text"} or (set(record) - {"id", "meta", "metadata", "source", "url"}) == {"text"}
