"""Read records from json, jsonl or parquet, keeping where each came from for error messages."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List

from ftctl.errors import FtctlError


@dataclass
class Record:
    data: Dict[str, Any]
    source: str  # "file:line" or "file:row N"


def read_records(path: str | Path) -> List[Record]:
    path = Path(path).expanduser()
    if not path.is_file():
        raise FtctlError(f"data file not found: {path}")
    suffix = path.suffix.lower()
    if suffix == ".jsonl":
        return _read_jsonl(path)
    if suffix == ".json":
        text = path.read_text(encoding="utf-8-sig")
        if text.lstrip().startswith("["):
            try:
                rows = json.loads(text)
            except json.JSONDecodeError as exc:
                raise FtctlError(f"{path}:{exc.lineno}: malformed JSON: {exc.msg} (column {exc.colno})") from None
            return [_as_record(row, f"{path}:item {i}") for i, row in enumerate(rows)]
        if text.lstrip().startswith("{"):
            _refuse_one_document(path, text)
        return _read_jsonl(path)
    if suffix == ".parquet":
        import pyarrow.parquet as pq  # directly: datasets would copy the file into its cache

        return [Record(row, f"{path}:row {i}") for i, row in enumerate(pq.read_table(path).to_pylist())]
    raise FtctlError(f"{path}: unsupported data file type '{suffix}' (use .json, .jsonl or .parquet)")


def _refuse_one_document(path: Path, text: str) -> None:
    """A .json file holding one (pretty-printed) object rather than JSON lines: say what ftctl reads."""
    try:
        document = json.loads(text)
    except json.JSONDecodeError:
        return  # JSON lines, or broken: the line reader names the line
    if not isinstance(document, dict) or text.strip().count("\n") == 0:
        return  # one record on one line is JSON lines
    from data_formats import guess_format

    lists = [key for key, value in document.items() if isinstance(value, list) and value and isinstance(value[0], dict)]
    if guess_format(document):
        where = " (this one is a single record spread over lines)"
    else:
        where = f" (the records look to be under '{lists[0]}': write that list alone)" if lists else ""
    raise FtctlError(f"{path}: one JSON object; ftctl reads a JSON array of records or one record per line{where}")


def _read_jsonl(path: Path) -> List[Record]:
    records = []
    with open(path, encoding="utf-8-sig") as f:
        for lineno, line in enumerate(f, start=1):
            line = line.rstrip("\r\n")  # a fault at the end of the line would be reported at the next line's column 1
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                at_end = ", the end of the line" if exc.pos >= len(line.rstrip()) else ""
                raise FtctlError(f"{path}:{lineno}: malformed JSON line: {exc.msg} (column {exc.pos + 1}{at_end})") from None
            records.append(_as_record(row, f"{path}:{lineno}"))
    return records


def _as_record(row: Any, source: str) -> Record:
    if not isinstance(row, dict):
        raise FtctlError(f"{source}: expected a JSON object, got {type(row).__name__}")
    return Record(row, source)
