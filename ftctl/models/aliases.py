"""Built-in model aliases: names a recipe can use in model.name_or_path that resolve to a local dir.

An alias materialises its model once under $FTCTL_HOME/models/<alias> and returns that dir.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable, Dict

from ftctl.errors import FtctlError
from ftctl.paths import ftctl_home

_BUILDERS: Dict[str, Callable[[Path], None]] = {}
_DESCRIPTIONS: Dict[str, str] = {}


def alias(name: str, description: str):
    def deco(fn: Callable[[Path], None]):
        _BUILDERS[name] = fn
        _DESCRIPTIONS[name] = description
        return fn

    return deco


def aliases() -> Dict[str, str]:
    return dict(_DESCRIPTIONS)


def is_alias(name: str) -> bool:
    return name in _BUILDERS


def resolve_alias(name: str) -> Path:
    """The local dir of an alias, building it on first use (atomically: a half-built dir is never used)."""
    target = ftctl_home() / "models" / name
    if (target / "config.json").is_file():
        return target
    staging = target.with_name(target.name + ".partial")
    shutil.rmtree(staging, ignore_errors=True)
    staging.mkdir(parents=True)
    try:
        _BUILDERS[name](staging)
    except FtctlError:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    shutil.rmtree(target, ignore_errors=True)
    staging.rename(target)
    return target


@alias("tiny-llama", "2-layer random Llama (hidden 64, vocab 512) with a ChatML BPE tokenizer; built locally")
def _tiny_llama(out: Path) -> None:
    from ftctl.models.tiny import build_tiny_llama

    build_tiny_llama(out)
