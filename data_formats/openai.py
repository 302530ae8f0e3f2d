"""OpenAI chat format: ``messages`` of ``{role, content}`` (the same conversation model as ShareGPT)."""

from __future__ import annotations

from data_formats import FormatError, register
from data_formats.sharegpt import ShareGPT


@register
class OpenAIMessages(ShareGPT):
    name = "openai"
    signature_fields = ("messages",)

    @classmethod
    def looks_like(cls, record):
        return "messages" in record

    def to_messages(self, record):
        if "messages" not in record:
            raise FormatError("missing required field 'messages'")
        return super().to_messages({"messages": record["messages"]})
