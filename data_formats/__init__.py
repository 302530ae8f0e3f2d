"""Dataset formats: each module here turns one kind of record into a conversation.

A format is a class registered by name with :func:`register`. It converts one record (a dict read
from a json, jsonl or parquet row, or a dataset's row) into a list of messages ``{"role":
system|user|assistant, "content": str}``, or, for a ``plain_text`` format, into one document. To add a format, drop a module into this folder (it is imported by name on
first use) or expose one from your own package under the ``ftctl.data_formats`` entry-point group;
the runner never changes.

Preference objectives (``objective=dpo``, simpo, orpo, kto) read records through :meth:`DataFormat.to_pair`
(a prompt and two answers, the first preferred) or :meth:`DataFormat.to_unpaired` (KTO: a prompt, one
answer and whether it is desirable). A format says which of the three readings it offers with
``gives_conversations``, ``gives_pairs`` and ``gives_unpaired``.
"""

from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Tuple, Type

Message = Dict[str, str]
ROLES = ("system", "user", "assistant")


class FormatError(ValueError):
    """A record that does not match its declared format; the loader adds file and line."""


@dataclass
class PreferencePair:
    """One prompt (a conversation ending in a user turn) and two answers to it, ``chosen`` preferred."""

    prompt: List[Message]
    chosen: str
    rejected: str


@dataclass
class LabelledAnswer:
    """KTO's unpaired example: one answer to ``prompt`` and whether it is desirable."""

    prompt: List[Message]
    answer: str
    desirable: bool


class DataFormat:
    """Base class: a named converter from records to conversations."""

    name: str = ""
    #: Field names whose presence identifies the format, used to suggest the right one.
    signature_fields: tuple = ()
    #: True for documents rather than conversations (continued pretraining): :meth:`to_text` gives
    #: the text, every token of which trains; no chat template applies.
    plain_text: bool = False
    #: Which readings the format offers: conversations to train with SFT (:meth:`to_messages`, or
    #: :meth:`to_text`), preference pairs (:meth:`to_pair`), KTO's labelled answers (:meth:`to_unpaired`).
    gives_conversations: bool = True
    gives_pairs: bool = False
    gives_unpaired: bool = False

    def to_messages(self, record: Dict[str, Any]) -> List[Message]:
        raise NotImplementedError

    def to_pair(self, record: Dict[str, Any]) -> PreferencePair:
        raise FormatError(f"data.format={self.name} holds no preference pairs (prompt, chosen, rejected)")

    def to_unpaired(self, record: Dict[str, Any]) -> LabelledAnswer:
        raise FormatError(f"data.format={self.name} holds no labelled answers (prompt, completion, label)")

    def to_text(self, record: Dict[str, Any]) -> str:
        raise NotImplementedError

    @classmethod
    def looks_like(cls, record: Dict[str, Any]) -> bool:
        return bool(cls.signature_fields) and all(f in record for f in cls.signature_fields)


_REGISTRY: Dict[str, Type[DataFormat]] = {}


def register(cls: Type[DataFormat]) -> Type[DataFormat]:
    _REGISTRY[cls.name] = cls
    return cls


def _discover() -> None:
    for module in pkgutil.iter_modules(__path__):
        if not module.name.startswith("_"):
            importlib.import_module(f"{__name__}.{module.name}")
    from importlib.metadata import entry_points

    for ep in entry_points(group="ftctl.data_formats"):
        ep.load()


def available() -> List[str]:
    if not _REGISTRY:
        _discover()
    return sorted(_REGISTRY)


def get_format(name: str) -> DataFormat:
    if name not in available():
        from ftctl.errors import ConfigError, did_you_mean

        choices = [AUTO, *available()]
        raise ConfigError(f"unknown data.format '{name}'.{did_you_mean(name, choices)} Available: {', '.join(choices)}")
    return _REGISTRY[name]()


def guess_format(record: Dict[str, Any]) -> List[str]:
    """Names of the registered formats this record looks like."""
    return [name for name in available() if _REGISTRY[name].looks_like(record)]


#: data.format's value that detects each source's format from its first record.
AUTO = "auto"


#: The readings of a record (:class:`DataFormat`): SFT conversations, preference pairs, KTO's labelled answers.
CONVERSATIONS, PAIRS, UNPAIRED = "conversations", "pairs", "unpaired"
_OWN_FORMAT = {PAIRS: "preference", UNPAIRED: "kto"}  # whose converter names what a record of that reading lacks


def detect_format(record: Dict[str, Any], reading: str = CONVERSATIONS) -> Tuple[str, str]:
    """(format, why) for ``data.format=auto``: the first format (by name) that the record looks like and
    converts; else the first it looks like, whose converter then names what is wrong with it.

    ``reading`` pairs or unpaired (preference objectives): among the formats that offer it, those that read
    the record, the ones it looks like first; else the one it looks like, or the reading's own format."""
    if reading != CONVERSATIONS:
        offering = [name for name in available() if _offers(name, reading)]
        looks = [name for name in guess_format(record) if name in offering]
        readable = sorted((name for name in offering if _converts(name, record, reading)), key=lambda name: name not in looks)
        name = (readable or looks or [_OWN_FORMAT[reading]])[0]
        why = f"its first record reads as {reading} in it" if readable else "no format reads its first record"
        return name, why + (f"; it reads as {', '.join(readable[1:])} too" if len(readable) > 1 else "")
    looks = guess_format(record)
    readable = [name for name in looks if _converts(name, record)] or looks
    if not readable:
        fields = ", ".join(repr(key) for key in sorted(record)) or "none"
        raise FormatError(f"data.format=auto cannot tell the format of a record with the fields {fields}; "
                          f"set data.format to one of {', '.join(available())}")
    name = readable[0]
    fields = [key for key in _REGISTRY[name].signature_fields if key in record] or sorted(record)
    why = f"its first record has {', '.join(repr(key) for key in fields)}"
    return name, why + (f"; it reads as {', '.join(readable[1:])} too" if len(readable) > 1 else "")


def _offers(name: str, reading: str) -> bool:
    fmt = _REGISTRY[name]
    return {CONVERSATIONS: fmt.gives_conversations, PAIRS: fmt.gives_pairs, UNPAIRED: fmt.gives_unpaired}[reading]


def _converts(name: str, record: Dict[str, Any], reading: str = CONVERSATIONS) -> bool:
    fmt = _REGISTRY[name]()
    try:
        if reading == PAIRS:
            fmt.to_pair(record)
        elif reading == UNPAIRED:
            fmt.to_unpaired(record)
        else:
            fmt.to_text(record) if fmt.plain_text else fmt.to_messages(record)
    except FormatError:
        return False
    return True


def other_format_hint(record: Dict[str, Any], tried: str) -> str:
    """' The record reads as data.format=X.' for another format that converts it, or ''."""
    for name in guess_format(record):
        if name != tried and _converts(name, record):
            return f" The record reads as data.format={name}."
    return ""


def with_system_prompt(messages: List[Message], system: Optional[str]) -> List[Message]:
    """``messages`` opened by ``system`` unless empty or the conversation has its own system turn."""
    if system and messages[0]["role"] != "system":
        return [{"role": "system", "content": system}] + messages
    return messages


def require_text(record: Dict[str, Any], key: str, *, optional: bool = False) -> str:
    value = record.get(key)
    if value is None:
        if optional:
            return ""
        raise FormatError(f"missing required field '{key}'")
    if not isinstance(value, str):
        raise FormatError(f"field '{key}' must be a string, got {type(value).__name__}")
    return value
