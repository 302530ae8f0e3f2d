"""Preference pairs: a prompt and two answers to it, the first preferred (TRL's preference format).

Accepted records:

- ``{"prompt": "...", "chosen": "...", "rejected": "..."}``, optionally with ``system``;
- ``prompt`` as a message list ending in a user turn, ``chosen``/``rejected`` as text or one assistant message;
- ``{"chosen": [messages], "rejected": [messages]}``: two whole conversations that share every turn but the
  last (the answers), the prompt being that shared prefix;
- ``{"messages": [...], "chosen": ..., "rejected": ...}``: the conversation up to the last user turn and the two
  final answers.

Any of them also trains KTO: a pair gives a desirable and an undesirable example of the same prompt.
"""

from __future__ import annotations

from data_formats import DataFormat, FormatError, register, require_text
from data_formats._preference import pair_after_conversation, pair_from_conversations, refuse_sft_record


@register
class Preference(DataFormat):
    name = "preference"
    signature_fields = ("chosen", "rejected")
    gives_conversations = False
    gives_pairs = True

    def to_pair(self, record):
        refuse_sft_record(record)
        system = require_text(record, "system", optional=True)
        for field in ("messages", "prompt"):
            if field in record:
                return pair_after_conversation(record, field, system)
        for field in ("chosen", "rejected"):
            if field not in record:
                raise FormatError(f"missing required field '{field}'")
        if isinstance(record["chosen"], list) and isinstance(record["rejected"], list):
            return pair_from_conversations(record)
        raise FormatError("missing required field 'prompt' (or 'messages'; or give 'chosen' and 'rejected' as whole conversations)")

    def to_messages(self, record):
        raise FormatError("a preference pair has two answers; train it with objective=dpo, simpo, orpo or kto, "
                          "or evaluate it with ftctl eval (reward accuracy)")
