"""User-facing errors: the CLI prints their message, never a traceback (unless --debug)."""

from __future__ import annotations

import difflib
from typing import Iterable


class FtctlError(Exception):
    """A problem the user can fix; the message says what and where."""

    exit_code = 1


class ConfigError(FtctlError):
    """A recipe, override or resolved config that does not validate."""

    exit_code = 2


def did_you_mean(word: str, candidates: Iterable[str], cutoff: float = 0.5) -> str:
    """' Did you mean 'x'?' for the closest candidate, or '' when nothing is close."""
    matches = difflib.get_close_matches(word, list(candidates), n=1, cutoff=cutoff)
    return f" Did you mean '{matches[0]}'?" if matches else ""
