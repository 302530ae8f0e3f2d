"""KTO's unpaired examples: ``{"prompt": ..., "completion": ..., "label": true|false}``.

``prompt`` is text or a message list ending in a user turn, ``completion`` text or one assistant
message, ``label`` a JSON boolean: true for a desirable answer, false for an undesirable one.
"""

from __future__ import annotations

from data_formats import DataFormat, FormatError, register, require_text
from data_formats._preference import unpaired


@register
class KTO(DataFormat):
    name = "kto"
    signature_fields = ("completion", "label")
    gives_conversations = False
    gives_unpaired = True

    def to_unpaired(self, record):
        return unpaired(record, require_text(record, "system", optional=True))

    def to_messages(self, record):
        raise FormatError("a KTO record is a labelled answer; train it with objective=kto")
