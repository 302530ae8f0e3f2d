"""Alpaca: ``instruction``, optional ``input``, ``output``, optional ``system``."""

from __future__ import annotations

from data_formats import DataFormat, register, require_text


@register
class Alpaca(DataFormat):
    name = "alpaca"
    signature_fields = ("instruction", "output")

    def to_messages(self, record):
        instruction = require_text(record, "instruction")
        extra = require_text(record, "input", optional=True)
        output = require_text(record, "output")
        system = require_text(record, "system", optional=True)
        user = f"{instruction}\n\n{extra}" if extra.strip() else instruction
        messages = [{"role": "system", "content": system}] if system else []
        return messages + [{"role": "user", "content": user}, {"role": "assistant", "content": output}]
