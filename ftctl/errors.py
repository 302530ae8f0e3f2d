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


def refused_pickle(path, exc: BaseException) -> FtctlError:
    """One line for a pickle torch's safe loader refused: which file, what it would have run, what to do."""
    import re

    found = re.search(r"GLOBAL ([\w.]+)", str(exc))
    calls = f": it would call {found.group(1)}" if found else ""
    return FtctlError(f"{path}: refused to unpickle{calls} (a pickle can run code; ftctl loads tensors and plain data "
                      "only); if you trust the file, convert it to safetensors")
