"""Alpaca: ``instruction``, optional ``input``, ``output``, optional ``system``.

Ranked for preference objectives (LLaMA-Factory's ranking datasets): ``chosen`` and ``rejected`` in place of
``output``, or ``output`` as a list ``[chosen, rejected]``, best first.
"""

from __future__ import annotations

from data_formats import DataFormat, FormatError, PreferencePair, register, require_text


@register
class Alpaca(DataFormat):
    name = "alpaca"
    signature_fields = ("instruction", "output")
    gives_pairs = True

    def to_messages(self, record):
        prompt = self._prompt(record)
        return prompt + [{"role": "assistant", "content": require_text(record, "output")}]

    def to_pair(self, record):
        from data_formats._preference import answer_text, refuse_sft_record

        if isinstance(record.get("output"), list):
            ranked = record["output"]
            if len(ranked) != 2 or not all(isinstance(a, str) for a in ranked):
                raise FormatError("a ranked 'output' must be a list of two answers, the preferred one first")
            return PreferencePair(self._prompt(record), ranked[0], ranked[1])
        refuse_sft_record(record)
        return PreferencePair(self._prompt(record), answer_text(record, "chosen"), answer_text(record, "rejected"))

    @staticmethod
    def _prompt(record):
        instruction = require_text(record, "instruction")
        extra = require_text(record, "input", optional=True)
        system = require_text(record, "system", optional=True)
        user = f"{instruction}\n\n{extra}" if extra.strip() else instruction
        messages = [{"role": "system", "content": system}] if system else []
        return messages + [{"role": "user", "content": user}]
