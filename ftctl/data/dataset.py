"""Tokenized datasets with a content-keyed cache, an eval split and the statistics a log needs."""

from __future__ import annotations

import hashlib
import inspect
import json
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Tuple

import numpy as np

from data_formats import FormatError, get_format, other_format_hint
from ftctl.config.schema import DataConfig
from ftctl.data.records import read_records
from ftctl.data.render import TemplateError, ensure_chat_template, tokenize_conversation
from ftctl.errors import FtctlError
from ftctl.paths import ftctl_home

log = logging.getLogger("ftctl")
_CACHE_VERSION = 1


@dataclass
class TokenizedDataset:
    """Examples stored flat: example i is ``input_ids[offsets[i]:offsets[i+1]]``."""

    input_ids: np.ndarray
    labels: np.ndarray
    offsets: np.ndarray
    stats: dict = field(default_factory=dict)

    def __len__(self) -> int:
        return len(self.offsets) - 1

    def __getitem__(self, i: int) -> Tuple[np.ndarray, np.ndarray]:
        a, b = self.offsets[i], self.offsets[i + 1]
        return self.input_ids[a:b], self.labels[a:b]

    def subset(self, indices) -> "TokenizedDataset":
        ids, labels, offsets = [], [], [0]
        for i in indices:
            x, y = self[i]
            ids.append(x)
            labels.append(y)
            offsets.append(offsets[-1] + len(x))
        cat = lambda parts: np.concatenate(parts) if parts else np.zeros(0, dtype=np.int32)  # noqa: E731
        return TokenizedDataset(cat(ids), cat(labels), np.asarray(offsets, dtype=np.int64))

    def trained_tokens(self) -> int:
        return int((self.labels != -100).sum())


def tokenizer_fingerprint(tokenizer) -> str:
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h.update(backend.to_str().encode() if backend is not None else repr(sorted(tokenizer.get_vocab().items())).encode())
    h.update(json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str).encode())
    h.update((tokenizer.chat_template or "").encode())
    return h.hexdigest()


def format_fingerprint(name: str) -> str:
    """Hash of the source of the modules defining the format and its base classes: editing a format's code re-tokenizes."""
    h = hashlib.sha256()
    for module in sorted({cls.__module__ for cls in type(get_format(name)).__mro__ if cls.__module__ != "builtins"}):
        try:
            h.update(inspect.getsource(sys.modules[module]).encode())
        except (KeyError, OSError, TypeError):
            h.update(module.encode())
    return h.hexdigest()


def _cache_key(path: Path, cfg: DataConfig, tokenizer) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    settings = {
        "v": _CACHE_VERSION,
        "format": cfg.format,
        "format_code": format_fingerprint(cfg.format),
        "max_seq_len": cfg.max_seq_len,
        "train_on_prompt": cfg.train_on_prompt,
        "system_prompt": cfg.system_prompt,
    }
    h.update(json.dumps(settings, sort_keys=True).encode())
    h.update(tokenizer_fingerprint(tokenizer).encode())
    return h.hexdigest()[:24]


def tokenize_file(path: str | Path, cfg: DataConfig, tokenizer) -> TokenizedDataset:
    fmt = get_format(cfg.format)
    ids, labels, offsets = [], [], [0]
    stats = {"examples": 0, "truncated": 0, "dropped_no_trained_tokens": 0}
    records = read_records(path)
    if not records:
        raise FtctlError(f"{path}: the file holds no examples")
    for record in records:
        try:
            messages = fmt.to_messages(record.data)
        except FormatError as exc:
            hint = other_format_hint(record.data, cfg.format)
            raise FtctlError(f"{record.source}: not a valid '{cfg.format}' record: {exc}.{hint}") from None
        if cfg.system_prompt and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": cfg.system_prompt}] + messages
        try:
            example = tokenize_conversation(messages, tokenizer, cfg.max_seq_len, cfg.train_on_prompt)
        except TemplateError as exc:
            raise FtctlError(f"{record.source}: {exc}") from None
        stats["examples"] += 1
        stats["truncated"] += example.truncated
        if example.trained_tokens == 0:
            stats["dropped_no_trained_tokens"] += 1
            if not example.truncated:  # nothing to train even in full: every assistant turn is context
                stats["dropped_no_trained_turn"] = stats.get("dropped_no_trained_turn", 0) + 1
            continue
        ids.append(np.asarray(example.input_ids, dtype=np.int32))
        labels.append(np.asarray(example.labels, dtype=np.int32))
        offsets.append(offsets[-1] + len(example.input_ids))
    if not ids:
        untrained = stats.get("dropped_no_trained_turn", 0)
        if untrained == stats["dropped_no_trained_tokens"]:
            raise FtctlError(
                f"{path}: every example was filtered out: none has an assistant turn to train (one after a user "
                "or system turn, not marked weight 0)"
            )
        raise FtctlError(
            f"{path}: every example was filtered out ({stats['dropped_no_trained_tokens'] - untrained} had no trained "
            f"token left after truncation to data.max_seq_len={cfg.max_seq_len}; {untrained} had no assistant turn "
            "to train); raise max_seq_len"
        )
    return TokenizedDataset(np.concatenate(ids), np.concatenate(labels), np.asarray(offsets, dtype=np.int64), stats)


def load_or_tokenize(path: str | Path, cfg: DataConfig, tokenizer) -> TokenizedDataset:
    """Tokenize ``path`` or reuse the cache entry keyed by its content, the tokenizer and the settings."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FtctlError(f"data file not found: {path} (data.path)")
    cache_root = Path(cfg.cache_dir).expanduser() if cfg.cache_dir else ftctl_home() / "data_cache"
    entry = cache_root / f"{_cache_key(path, cfg, tokenizer)}.npz"
    if entry.is_file():
        with np.load(entry, allow_pickle=False) as z:
            stats = json.loads(str(z["stats"]))
            data = TokenizedDataset(z["input_ids"], z["labels"], z["offsets"], stats)
        data.stats["cache"] = "hit"
        return data
    data = tokenize_file(path, cfg, tokenizer)
    entry.parent.mkdir(parents=True, exist_ok=True)
    tmp = entry.with_name(f"{entry.stem}.{os.getpid()}.tmp.npz")
    np.savez(tmp, input_ids=data.input_ids, labels=data.labels, offsets=data.offsets, stats=json.dumps(data.stats))
    os.replace(tmp, entry)
    data.stats["cache"] = "miss"
    return data


def build_datasets(cfg: DataConfig, tokenizer, seed: int) -> Tuple[TokenizedDataset, Optional[TokenizedDataset]]:
    """The train split and the eval split (a separate file, a seeded fraction, or none)."""
    ensure_chat_template(tokenizer, cfg.chat_template)
    full = load_or_tokenize(cfg.path, cfg, tokenizer)
    stats = dict(full.stats)
    if cfg.eval_path:
        return _with_stats(full, stats), load_or_tokenize(cfg.eval_path, cfg, tokenizer)
    if cfg.eval_fraction > 0:
        order = np.random.default_rng(seed).permutation(len(full))
        n_eval = max(1, int(round(len(full) * cfg.eval_fraction)))
        if n_eval >= len(full):
            raise FtctlError(f"data.eval_fraction={cfg.eval_fraction} leaves no training example out of {len(full)}")
        return _with_stats(full.subset(sorted(order[n_eval:])), stats), full.subset(sorted(order[:n_eval]))
    return full, None


def _with_stats(data: TokenizedDataset, stats: dict) -> TokenizedDataset:
    data.stats = stats
    return data
