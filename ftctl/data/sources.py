"""Where training records come from: a file, a directory of files, a saved dataset, or a hub dataset.

``data.path`` (and each ``data.mixture`` entry's path) is resolved here, in this order: an existing
file; an existing directory, which is a ``datasets.save_to_disk`` directory when it holds
``state.json`` (a Dataset) or ``dataset_dict.json`` (a DatasetDict, split by ``data.split``), and
otherwise every .json/.jsonl/.parquet file directly in it, in name order; else ``hf://org/name`` or
``org/name`` is a Hugging Face dataset, loaded through ``datasets`` (``data.split``,
``data.subset``). When the Hub cannot be reached (``HF_HUB_OFFLINE`` set, or no answer within a
second or two) the dataset is read from the local datasets cache, and one that is not there is an
error at once rather than after the library's retries.

Locating a source (:func:`locate`) and the offline check touch only the filesystem, so ``--dry-run``
and the pre-start checks make them; reading (:func:`read_source`) imports ``datasets`` only for
saved and hub datasets.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import List, Optional

from ftctl.errors import FtctlError

DATA_FILE_SUFFIXES = (".json", ".jsonl", ".parquet")
HUB_PREFIX = "hf://"
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[A-Za-z0-9][\w.-]*$")
_WHAT_PATH_TAKES = "a .json/.jsonl/.parquet file, a directory of them, a save_to_disk directory or a hub dataset id (hf://org/name)"


@dataclass(frozen=True)
class DataSource:
    kind: str  # "file", "directory", "saved" (save_to_disk) or "hub"
    location: str  # the path, or the hub id without hf://
    key: str  # the config key that named it, for messages
    value: str  # what the user wrote
    split: str = "train"
    subset: Optional[str] = None

    def describe(self) -> str:
        if self.kind == "hub":
            return f"hub dataset {self.location}" + (f" ({self.subset})" if self.subset else "") + f" [{self.split}]"
        if self.kind == "saved":
            return f"saved dataset {self.location}" + (f" [{self.split}]" if _is_dataset_dict(Path(self.location)) else "")
        if self.kind == "directory":
            return f"{self.location}/ ({len(data_files(Path(self.location)))} files)"
        return self.location


def _is_saved_dataset(path: Path) -> bool:
    return (path / "state.json").is_file() or _is_dataset_dict(path)


def _is_dataset_dict(path: Path) -> bool:
    return (path / "dataset_dict.json").is_file()


def data_files(directory: Path) -> List[Path]:
    return sorted(p for p in directory.iterdir() if p.is_file() and p.suffix.lower() in DATA_FILE_SUFFIXES)


def locate(value: str, key: str = "data.path", split: str = "train", subset: Optional[str] = None, *,
           check_hub: bool = True) -> DataSource:
    """What ``value`` names, checked as far as the filesystem can tell; a hub id, with ``check_hub``, only
    when the Hub is unreachable (then it must be in the local cache)."""
    if value.startswith(HUB_PREFIX):
        source = DataSource("hub", value[len(HUB_PREFIX):].strip("/"), key, value, split, subset)
        if not _HUB_ID.match(source.location) and "/" in source.location:
            raise FtctlError(f"{key}={value}: not a hub dataset id; write hf://org/name")
        if check_hub:
            _check_hub_reachable_or_cached(source)
        return source
    path = Path(value).expanduser()
    if path.is_file():
        return DataSource("file", str(path), key, value, split, subset)
    if path.is_dir():
        if _is_saved_dataset(path):
            source = DataSource("saved", str(path), key, value, split, subset)
            _check_saved_split(source)
            return source
        if not data_files(path):
            raise FtctlError(f"{key}={value}: the directory holds no .json, .jsonl or .parquet file (nor a save_to_disk dataset)")
        return DataSource("directory", str(path), key, value, split, subset)
    if _HUB_ID.match(value) and not _looks_local(path):
        source = DataSource("hub", value, key, value, split, subset)
        if check_hub:
            _check_hub_reachable_or_cached(source)
        return source
    raise FtctlError(f"{key}={value}: no such file or directory; give {_WHAT_PATH_TAKES}")


def locate_all(d, *, check_hub: bool = True) -> List[DataSource]:
    """Every source a DataConfig names (the mixture's, or data.path; then data.eval_path and data.eval_sets), located."""
    from ftctl.config.eval_sets import named_eval_sets

    named = [(f"data.mixture[{i}].path", m.path, m.split or d.split, m.subset if m.subset is not None else d.subset)
             for i, m in enumerate(d.mixture)] or [("data.path", d.path, d.split, d.subset)]
    named += [("data.eval_path", d.eval_path, d.eval_split, d.subset)] if d.eval_path else []
    named += [(f"data.eval_sets.{name}.path", s.path, s.split or d.eval_split, s.subset if s.subset is not None else d.subset)
              for name, s in named_eval_sets(d.eval_sets).items()]
    return [locate(value, key, split, subset, check_hub=check_hub) for key, value, split, subset in named]


def _sibling_key(source: DataSource, name: str) -> str:
    """The key that sets the source's split or subset: data.split, data.mixture[1].split, data.eval_split."""
    if source.key == "data.eval_path" and name == "split":
        return "data.eval_split"
    return source.key.rsplit(".", 1)[0] + "." + name


def _looks_local(path: Path) -> bool:
    """'data/train.jsonl' (a data file's name, or under a directory that exists here) is a missing file, not a hub id."""
    return path.suffix.lower() in DATA_FILE_SUFFIXES + (".csv", ".arrow", ".txt") or path.parent.is_dir()


def _check_saved_split(source: DataSource) -> None:
    path = Path(source.location)
    if not _is_dataset_dict(path):
        return
    splits = json.loads((path / "dataset_dict.json").read_text()).get("splits", [])
    if source.split not in splits:
        raise FtctlError(f"{source.key}={source.value} has no split '{source.split}'; "
                         f"set {_sibling_key(source, 'split')} to one of: {', '.join(splits)}")


# --- the Hub, offline ---------------------------------------------------------------------------

def datasets_cache_dir() -> Path:
    """Where ``datasets`` keeps prepared datasets, by its own rule, read now (not at its import)."""
    if os.environ.get("HF_DATASETS_CACHE"):
        return Path(os.environ["HF_DATASETS_CACHE"]).expanduser()
    hf_home = os.environ.get("HF_HOME") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "huggingface")
    return Path(hf_home).expanduser() / "datasets"


def _cached_dir(repo_id: str) -> Path:
    """datasets caches org/name as org___name (its name part in snake case, as it names builders)."""
    from_camel = re.sub(r"(?<=[a-z0-9])(?=[A-Z])", "_", repo_id.split("/")[-1]).lower()
    return datasets_cache_dir() / "___".join(repo_id.split("/")[:-1] + [from_camel])


def hub_unreachable_reason() -> Optional[str]:
    """The model ids' hub probe (ftctl.models.hub), with the datasets library's own offline switch."""
    from ftctl.models.hub import hub_unreachable_reason as reason

    return reason("HF_DATASETS_OFFLINE")


def _check_hub_reachable_or_cached(source: DataSource) -> None:
    reason = hub_unreachable_reason()
    if not reason:
        return
    cached = _cached_dir(source.location)
    if not cached.is_dir():
        raise FtctlError(
            f"{source.key}={source.value}: the Hub cannot be reached ({reason}) and the dataset is not in the local "
            f"datasets cache ({datasets_cache_dir()}); load it once where the Hub is reachable, or give a file or a "
            "save_to_disk directory"
        )
    subsets = sorted(p.name for p in cached.iterdir() if p.is_dir())
    if source.subset and source.subset not in subsets:
        raise FtctlError(
            f"{source.key}={source.value}: the Hub cannot be reached ({reason}) and the local datasets cache holds "
            f"no subset '{source.subset}' of it; set {_sibling_key(source, 'subset')} to one it holds: {', '.join(subsets)}"
        )


# --- reading --------------------------------------------------------------------------------------

def read_source(source: DataSource):
    """The source's records (ftctl.data.records.Record), each knowing where it came from, as a list."""
    return list(iter_source(source))


def iter_source(source: DataSource, limit=None):
    """The source's records one at a time: memory holds one record, not the source.

    ``limit`` (a RecordLimit) skips and counts records longer than it allows, without holding them.
    """
    from ftctl.data.records import RecordLimit, iter_records

    limit = limit or RecordLimit()
    if source.kind == "file":
        return iter_records(source.location, limit)
    if source.kind == "directory":
        return (record for path in data_files(Path(source.location)) for record in iter_records(path, limit))
    dataset = _load_saved(source) if source.kind == "saved" else _load_hub(source)
    return _dataset_records(dataset, source.describe(), limit)


def _dataset_records(dataset, where: str, limit):
    from ftctl.data.records import Record, text_size

    for i, row in enumerate(dataset):
        if not limit.over(text_size(row), f"{where} row {i}"):
            yield Record(row, f"{where} row {i}")


def _load_saved(source: DataSource):
    import datasets

    loaded = datasets.load_from_disk(source.location)
    if isinstance(loaded, datasets.DatasetDict):
        _check_saved_split(source)
        return loaded[source.split]
    return loaded


@functools.lru_cache(maxsize=8)  # the cache key and the records both need it; loading maps the files again
def _load_hub(source: DataSource):
    offline = hub_unreachable_reason()
    _check_hub_reachable_or_cached(source)
    import datasets

    cache_dir = str(datasets_cache_dir())
    saved = datasets.config.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = saved or bool(offline)  # read from the cache without trying the network
    # "Using the latest cached version ..." is what offline means here; ftctl's log names the source.
    library_log = logging.getLogger("datasets")
    level, library_log.level = library_log.level, logging.ERROR
    try:
        return datasets.load_dataset(source.location, name=source.subset, split=source.split, cache_dir=cache_dir)
    except Exception as exc:  # datasets raises many types (ValueError, ConnectionError, its own); all name the cause
        message = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise FtctlError(
            f"{source.key}={source.value}: cannot load the hub dataset ({message}); check the id, "
            f"{_sibling_key(source, 'split')}={source.split} and {_sibling_key(source, 'subset')}={source.subset}"
        ) from None
    finally:
        datasets.config.HF_HUB_OFFLINE = saved
        library_log.setLevel(level)


def fingerprint(source: DataSource) -> str:
    """A hash of the source's content, for the tokenized-data cache: edited data is tokenized again."""
    h = hashlib.sha256(json.dumps([source.kind, source.location, source.split, source.subset]).encode())
    if source.kind == "hub":
        # The prepared dataset's own fingerprint names its content and revision.
        h.update(str(_load_hub(source)._fingerprint).encode())
        return h.hexdigest()
    root = Path(source.location)
    if source.kind == "saved":
        # save_to_disk writes a new fingerprint into state.json with every save, so the small JSON files (and
        # the data files' names and sizes) tell a changed dataset without reading gigabytes of Arrow data.
        for path in sorted(p for p in root.rglob("*") if p.is_file()):
            h.update(f"{path.relative_to(root)}:{path.stat().st_size}".encode())
            if path.suffix == ".json":
                h.update(path.read_bytes())
        return h.hexdigest()
    files = [root] if source.kind == "file" else data_files(root)
    for path in files:
        h.update(str(path.relative_to(root) if path != root else path.name).encode())
        with open(path, "rb") as f:
            for chunk in iter(lambda: f.read(1 << 20), b""):
                h.update(chunk)
    return h.hexdigest()
