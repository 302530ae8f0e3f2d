"""Tokenized datasets with a content-keyed cache, an eval split and the statistics a log needs."""

from __future__ import annotations

import functools
import hashlib
import inspect
import itertools
import json
import logging
import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, Iterable, Iterator, List, Optional, Tuple

import numpy as np

from data_formats import AUTO, FormatError, available, detect_format, get_format, other_format_hint, with_system_prompt
from ftctl.config.schema import DataConfig
from ftctl.data.records import Record, RecordLimit
from ftctl.data.render import TemplateError, ensure_chat_template, tokenize_conversation, tokenize_text
from ftctl.data.sources import DataSource, fingerprint, iter_source, locate
from ftctl.errors import FtctlError
from ftctl.paths import ftctl_home

log = logging.getLogger("ftctl")
_CACHE_VERSION = 3  # 2: keyed by the source (file, directory, saved or hub dataset), not a file alone; 3: stats name the format


@dataclass
class TokenizedDataset:
    """Examples stored flat: example i is ``input_ids[offsets[i]:offsets[i+1]]``."""

    input_ids: np.ndarray
    labels: np.ndarray
    offsets: np.ndarray
    stats: dict = field(default_factory=dict)
    #: Set when data.mixture built it: each source's example count and weight, in source order (the
    #: examples of source k follow those of source k-1), which the step sampler mixes by.
    mixture: Optional["Mixture"] = None

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

    @functools.cached_property
    def trained_per_example(self) -> np.ndarray:
        """Each example's trained tokens as a micro-batch counts them: its labels after the first position."""
        trained = np.concatenate([[0], np.cumsum(self.labels != -100)])
        starts, ends = self.offsets[:-1], self.offsets[1:]
        return trained[ends] - trained[np.minimum(starts + 1, ends)]


def tokenizer_fingerprint(tokenizer) -> str:
    h = hashlib.sha256()
    backend = getattr(tokenizer, "backend_tokenizer", None)
    h.update(backend.to_str().encode() if backend is not None else repr(sorted(tokenizer.get_vocab().items())).encode())
    h.update(json.dumps(tokenizer.special_tokens_map, sort_keys=True, default=str).encode())
    h.update((tokenizer.chat_template or "").encode())
    return h.hexdigest()


def _module_fingerprint(module: str) -> str:
    try:
        return hashlib.sha256(inspect.getsource(sys.modules[module]).encode()).hexdigest()
    except (KeyError, OSError, TypeError):
        return module


def format_fingerprint(name: str) -> str:
    """Hash of the source of the modules defining the format and its base classes (every format's for
    ``auto``, which may choose any): editing a format's code re-tokenizes."""
    h = hashlib.sha256()
    names = available() if name == AUTO else [name]
    for module in sorted({cls.__module__ for n in names for cls in type(get_format(n)).__mro__ if cls.__module__ != "builtins"}):
        try:
            h.update(inspect.getsource(sys.modules[module]).encode())
        except (KeyError, OSError, TypeError):
            h.update(module.encode())
    return h.hexdigest()


@dataclass(frozen=True)
class Mixture:
    sizes: Tuple[int, ...]
    weights: Tuple[float, ...]


def _cache_key(source: DataSource, data_format: str, cfg: DataConfig, tokenizer) -> str:
    h = hashlib.sha256(fingerprint(source).encode())
    settings = {
        "v": _CACHE_VERSION,
        "format": data_format,
        "format_code": format_fingerprint(data_format),
        "render_code": _module_fingerprint("ftctl.data.render"),
        "max_seq_len": cfg.max_seq_len,
        "train_on_prompt": cfg.train_on_prompt,
        "system_prompt": cfg.system_prompt,
        "max_record_bytes": cfg.max_record_bytes,
    }
    h.update(json.dumps(settings, sort_keys=True).encode())
    h.update(tokenizer_fingerprint(tokenizer).encode())
    return h.hexdigest()[:24]


def tokenize_file(path: str | Path, cfg: DataConfig, tokenizer) -> TokenizedDataset:
    source = locate(str(path), "data.path", cfg.split, cfg.subset)
    limit = RecordLimit(cfg.max_record_bytes)
    return tokenize_records(iter_source(source, limit), source, cfg.format, cfg, tokenizer, limit)


def first_record(records: Iterable[Record], source: DataSource, limit: Optional[RecordLimit] = None) -> Tuple[Record, Iterator[Record]]:
    """(the first record, every record again, the first put back): what data.format=auto reads before the rest.
    A source without a record is one line (with what data.max_record_bytes skipped)."""
    records = iter(records)
    first = next(records, None)
    if first is None:
        where = source.location if source.kind != "hub" else source.value
        skipped = f"; {limit.summary()}" if limit is not None and limit.skipped else ""
        raise FtctlError(f"{where}: the {'file' if source.kind == 'file' else 'dataset'} holds no examples{skipped}")
    return first, itertools.chain([first], records)


def tokenize_records(records: Iterable[Record], source: DataSource, data_format: str, cfg: DataConfig, tokenizer,
                     limit: Optional[RecordLimit] = None) -> TokenizedDataset:
    """Tokenize records as they come (a generator keeps only one in memory), with the counts a log needs."""
    ids, labels, offsets = [], [], [0]
    stats = {"examples": 0, "truncated": 0, "dropped_no_trained_tokens": 0}
    where = source.location if source.kind != "hub" else source.value
    first, records = first_record(records, source, limit)
    stats.update(source=source.describe(), key=source.key, format=data_format, format_detected=None)
    if data_format == AUTO:
        try:
            data_format, stats["format_detected"] = detect_format(first.data)
        except FormatError as exc:
            raise FtctlError(f"{first.source}: {exc}") from None
        stats["format"] = data_format
    fmt = get_format(data_format)
    for record in records:
        try:
            if fmt.plain_text:
                examples = tokenize_text(fmt.to_text(record.data), tokenizer, cfg.max_seq_len)
                stats["split_documents"] = stats.get("split_documents", 0) + (len(examples) > 1)
            else:
                examples = [_tokenize_chat(fmt.to_messages(record.data), cfg, tokenizer, record)]
        except FormatError as exc:
            hint = other_format_hint(record.data, data_format)
            raise FtctlError(f"{record.source}: not a valid '{data_format}' record: {exc}.{hint}") from None
        for example in examples:
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
    if limit is not None and limit.skipped:
        stats["skipped_too_long"] = limit.skipped
        stats["skipped_note"] = limit.summary()
    if not ids:
        untrained = stats.get("dropped_no_trained_turn", 0)
        if untrained == stats["dropped_no_trained_tokens"]:
            raise FtctlError(
                f"{where}: every example was filtered out: none has an assistant turn to train (one after a user "
                "or system turn, not marked weight 0)"
            )
        raise FtctlError(
            f"{where}: every example was filtered out ({stats['dropped_no_trained_tokens'] - untrained} had no trained "
            f"token left after truncation to data.max_seq_len={cfg.max_seq_len}; {untrained} had no assistant turn "
            "to train); raise max_seq_len"
        )
    return TokenizedDataset(np.concatenate(ids), np.concatenate(labels), np.asarray(offsets, dtype=np.int64), stats)


def _tokenize_chat(messages, cfg: DataConfig, tokenizer, record: Record):
    try:
        return tokenize_conversation(with_system_prompt(messages, cfg.system_prompt), tokenizer, cfg.max_seq_len,
                                     cfg.train_on_prompt)
    except TemplateError as exc:
        raise FtctlError(f"{record.source}: {exc}") from None


def load_or_tokenize(
    path: str | Path | DataSource, cfg: DataConfig, tokenizer, data_format: Optional[str] = None, key: str = "data.path"
) -> TokenizedDataset:
    """Tokenize a source (a data.path value, or a located DataSource) in ``data_format`` (default data.format),
    or reuse the cache entry keyed by its content, the tokenizer and the settings."""
    source = path if isinstance(path, DataSource) else locate(str(path), key, cfg.split, cfg.subset)
    data_format = data_format or cfg.format
    cache_root = Path(cfg.cache_dir).expanduser() if cfg.cache_dir else ftctl_home() / "data_cache"
    entry = cache_root / f"{_cache_key(source, data_format, cfg, tokenizer)}.npz"
    if entry.is_file():
        with np.load(entry, allow_pickle=False) as z:
            stats = json.loads(str(z["stats"]))
            data = TokenizedDataset(z["input_ids"], z["labels"], z["offsets"], stats)
        data.stats["cache"] = "hit"
    else:
        limit = RecordLimit(cfg.max_record_bytes)
        data = tokenize_records(iter_source(source, limit), source, data_format, cfg, tokenizer, limit)
        write_cache(entry, data)
    if data.stats.get("skipped_note"):
        log.warning("%s: %s", source.describe(), data.stats["skipped_note"])
    return data


def write_cache(entry: Path, data, **arrays: np.ndarray) -> None:
    """Keep the tokenized data (and ``arrays``, e.g. preference data's labels) for the next run; a cache that
    cannot be written costs a warning, not the run."""
    tmp = entry.with_name(f"{entry.stem}.{os.getpid()}.tmp.npz")
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        np.savez(tmp, input_ids=data.input_ids, labels=data.labels, offsets=data.offsets, stats=json.dumps(data.stats), **arrays)
        os.replace(tmp, entry)
        data.stats["cache"] = "miss"
    except OSError as exc:
        from ftctl.fs_faults import fault_errno, fault_message

        tmp.unlink(missing_ok=True)
        code = fault_errno(exc, entry.parent)
        if code is None:
            raise
        log.warning("tokenized data not cached: %s", fault_message(code, entry.parent, "the tokenized-data cache", data.input_ids.nbytes * 2))
        data.stats["cache"] = "not written"


def build_datasets(cfg: DataConfig, tokenizer, seed: int) -> Tuple[TokenizedDataset, Optional[TokenizedDataset]]:
    """The train split and the eval split (a separate file, a seeded fraction, or none)."""
    ensure_chat_template(tokenizer, cfg.chat_template)
    if cfg.mixture:
        train, held_out = _build_mixture(cfg, tokenizer, seed)
    else:
        train, held_out = _hold_out(load_or_tokenize(cfg.path, cfg, tokenizer), cfg.eval_fraction, seed)
    if cfg.eval_path:
        evaluation = locate(cfg.eval_path, "data.eval_path", cfg.eval_split, cfg.subset)
        return train, load_or_tokenize(evaluation, cfg, tokenizer)
    return train, held_out


def build_eval_sets(cfg: DataConfig, tokenizer) -> Dict[str, TokenizedDataset]:
    """The named eval sets of data.eval_sets, each tokenized (and cached) in its own format, as training renders examples."""
    from ftctl.config.eval_sets import named_eval_sets

    ensure_chat_template(tokenizer, cfg.chat_template)
    sets = {}
    for name, entry in named_eval_sets(cfg.eval_sets).items():
        source = locate(entry.path, f"data.eval_sets.{name}.path", entry.split or cfg.eval_split,
                        entry.subset if entry.subset is not None else cfg.subset)
        sets[name] = load_or_tokenize(source, cfg, tokenizer, entry.format or cfg.format)
    return sets


def _hold_out(full: TokenizedDataset, fraction: float, seed: int) -> Tuple[TokenizedDataset, Optional[TokenizedDataset]]:
    """A seeded ``fraction`` of the examples for eval, and the rest, both in their original order."""
    if fraction <= 0:
        return full, None
    order = np.random.default_rng(seed).permutation(len(full))
    n_eval = max(1, int(round(len(full) * fraction)))
    if n_eval >= len(full):
        raise FtctlError(f"data.eval_fraction={fraction} leaves no training example out of {len(full)}")
    return _with_stats(full.subset(sorted(order[n_eval:])), dict(full.stats)), full.subset(sorted(order[:n_eval]))


def _build_mixture(cfg: DataConfig, tokenizer, seed: int) -> Tuple[TokenizedDataset, Optional[TokenizedDataset]]:
    """Every source tokenized (and cached) on its own, in its own format; eval_fraction holds out a share of each."""
    trains, evals, described = [], [], []
    for i, entry in enumerate(cfg.mixture):
        source = locate(entry.path, f"data.mixture[{i}].path", entry.split or cfg.split,
                        entry.subset if entry.subset is not None else cfg.subset)
        data_format = entry.format or cfg.format
        train, held_out = _hold_out(load_or_tokenize(source, cfg, tokenizer, data_format), cfg.eval_fraction, seed + i)
        trains.append(train)
        evals += [held_out] if held_out is not None else []
        described.append({"source": source.describe(), "format": train.stats["format"], "format_detected": train.stats["format_detected"],
                          "weight": entry.weight, "examples": len(train)})
    combined = _concatenate(trains)
    combined.mixture = Mixture(tuple(len(t) for t in trains), tuple(float(e.weight) for e in cfg.mixture))
    for name in ("examples", "truncated", "dropped_no_trained_tokens", "split_documents"):
        combined.stats[name] = sum(t.stats.get(name, 0) for t in trains)
    combined.stats["cache"] = ",".join(t.stats.get("cache", "-") for t in trains)
    from ftctl.data.batching import mixture_quotas

    quotas = mixture_quotas(combined.mixture.sizes, combined.mixture.weights)
    for part, quota in zip(described, quotas):
        part["share"] = quota / len(combined)
    combined.stats["mixture"] = described
    return combined, (_concatenate(evals) if evals else None)


def _concatenate(parts: List[TokenizedDataset]) -> TokenizedDataset:
    starts = np.cumsum([0] + [len(p.input_ids) for p in parts[:-1]])
    offsets = np.concatenate([parts[0].offsets[:1]] + [p.offsets[1:] + start for p, start in zip(parts, starts)])
    return TokenizedDataset(
        np.concatenate([p.input_ids for p in parts]), np.concatenate([p.labels for p in parts]), offsets.astype(np.int64), {}
    )


def format_summary(stats: dict) -> str:
    """"data.path=x.jsonl: sharegpt (data.format=auto: its first record has 'conversations')" for the log."""
    detected = stats.get("format_detected")
    return f"{stats.get('key')}={stats.get('source')}: {stats.get('format')}" + (f" (data.format=auto: {detected})" if detected else "")


def mixture_summary(stats: dict) -> str:
    """'75.0% a.jsonl: alpaca, weight 3, 40 examples; 25.0% ...' for the log and the preview."""
    return "; ".join(
        f"{part['share']:.1%} {part['source']}: {part['format']}"
        + (f" (data.format=auto: {part['format_detected']})" if part.get("format_detected") else "")
        + f", weight {part['weight']:g}, {part['examples']} examples"
        for part in stats.get("mixture", [])
    )


def _with_stats(data: TokenizedDataset, stats: dict) -> TokenizedDataset:
    data.stats = stats
    return data
