"""`key=value` command options (eval, chat, generate, merge, push) checked into one clear message."""

from __future__ import annotations

from typing import Dict, Optional, Type

from ftctl.errors import FtctlError


def number_option(options: Dict[str, str], key: str, kind, default, low, high=None,
                  error: Type[FtctlError] = FtctlError):
    raw: Optional[str] = options.get(key)
    if raw is None:
        return default
    try:
        value = kind(raw)
    except ValueError:
        raise error(f"{key}={raw}: expected {'an integer' if kind is int else 'a number'}") from None
    if value < low or (high is not None and value > high):
        raise error(f"{key}={raw}: must be {f'between {low} and {high}' if high is not None else f'at least {low}'}")
    return value


def bool_option(key: str, value: str) -> bool:
    if value.lower() in ("true", "false"):
        return value.lower() == "true"
    raise FtctlError(f"{key}={value}: expected true or false")
