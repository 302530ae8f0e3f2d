"""Read records from json, jsonl or parquet, one at a time, keeping where each came from for error messages.

Memory stays bounded by the longest record kept, not by the file: JSON lines are read line by line
and a JSON array element by element (a byte scanner finds the elements' ends), parquet by row
batches. A record longer than the limit (``data.max_record_bytes``) is skipped without being held
in memory, and counted (:class:`RecordLimit`). Bytes that are not UTF-8 are reported as
``file:line:column``.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Dict, Iterator, List, Optional, Tuple

from ftctl.errors import FtctlError
from ftctl.text_files import decode_utf8

_BOM = b"\xef\xbb\xbf"
_CHUNK = 1 << 20
_ONE_DOCUMENT_PARSE_LIMIT = 64 << 20  # a single pretty-printed object is parsed whole for its hint only up to this size


@dataclass
class Record:
    data: Dict[str, Any]
    source: str  # "file:line" or "file:row N"


@dataclass
class RecordLimit:
    """Records whose text is longer than ``max_bytes`` (0: no limit) are skipped, counted, and the first one named."""

    max_bytes: int = 0
    skipped: int = 0
    first: Optional[Tuple[str, int]] = field(default=None)  # (where, bytes)

    def over(self, size: int, where: str) -> bool:
        if not self.max_bytes or size <= self.max_bytes:
            return False
        self.skipped += 1
        self.first = self.first or (where, size)
        return True

    def summary(self) -> Optional[str]:
        if not self.skipped:
            return None
        where, size = self.first
        return (f"skipped {self.skipped} record{'s' if self.skipped > 1 else ''} longer than data.max_record_bytes="
                f"{self.max_bytes} (the first: {where}, {size} bytes); raise data.max_record_bytes to keep them")


def read_records(path: str | Path, limit: Optional[RecordLimit] = None) -> List[Record]:
    return list(iter_records(path, limit))


def iter_records(path: str | Path, limit: Optional[RecordLimit] = None) -> Iterator[Record]:
    """The file's records in order (checked before the first one is read: the file exists and its type is known)."""
    path = Path(path).expanduser()
    if not path.is_file():
        raise FtctlError(f"data file not found: {path}")
    suffix = path.suffix.lower()
    limit = limit or RecordLimit()
    if suffix == ".jsonl":
        return _iter_jsonl(path, limit)
    if suffix == ".json":
        first = _first_byte(path)
        if first == b"[":
            return _iter_json_array(path, limit)
        if first == b"{":
            _refuse_one_document(path)
        return _iter_jsonl(path, limit)
    if suffix == ".parquet":
        return _iter_parquet(path, limit)
    raise FtctlError(f"{path}: unsupported data file type '{suffix}' (use .json, .jsonl or .parquet)")


def _first_byte(path: Path) -> bytes:
    with open(path, "rb") as f:
        head = f.read(4096)
        while head and not head.removeprefix(_BOM).lstrip():
            more = f.read(4096)
            if not more:
                break
            head += more
    return head.removeprefix(_BOM).lstrip()[:1]


def _refuse_one_document(path: Path) -> None:
    """A .json file holding one (pretty-printed) object rather than JSON lines: say what ftctl reads."""
    with open(path, "rb") as f:
        first_line = f.readline(_CHUNK).removeprefix(_BOM)
    try:
        json.loads(first_line)
        return  # the first line is a record of its own: JSON lines
    except ValueError:
        pass
    if path.stat().st_size > _ONE_DOCUMENT_PARSE_LIMIT:
        return  # too big to parse for a hint; the line reader names the line
    try:
        text = decode_utf8(path.read_bytes().removeprefix(_BOM), path, 1)
        document = json.loads(text)
    except (json.JSONDecodeError, FtctlError):
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


def _iter_jsonl(path: Path, limit: RecordLimit) -> Iterator[Record]:
    with open(path, "rb") as f:
        lineno = 0
        while True:
            raw = f.readline(limit.max_bytes + 1) if limit.max_bytes else f.readline()
            if not raw:
                return
            lineno += 1
            if limit.max_bytes and len(raw) > limit.max_bytes and not raw.endswith(b"\n"):
                size = len(raw)
                while raw and not raw.endswith(b"\n"):  # the rest of the line, read and dropped a chunk at a time
                    raw = f.readline(_CHUNK)
                    size += len(raw)
                limit.over(size - raw.endswith(b"\n"), f"{path}:{lineno}")
                continue
            if lineno == 1:
                raw = raw.removeprefix(_BOM)
            line = decode_utf8(raw, path, lineno).rstrip("\r\n")  # a fault at the end would be reported at the next line
            if not line.strip():
                continue
            if limit.over(len(raw.rstrip(b"\r\n")), f"{path}:{lineno}"):
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as exc:
                at_end = ", the end of the line" if exc.pos >= len(line.rstrip()) else ""
                raise FtctlError(f"{path}:{lineno}: malformed JSON line: {exc.msg} (column {exc.pos + 1}{at_end})") from None
            yield _as_record(row, f"{path}:{lineno}")


_STRUCTURE = re.compile(rb'[\[\]{},"]')
_IN_STRING = re.compile(rb'["\\]')


def _json_array_elements(path: Path, limit: RecordLimit) -> Iterator[Tuple[int, int, int, Optional[bytes], int]]:
    """(line of its first character, line and column where its bytes start, bytes, size) of each element of the
    file's top-level JSON array; bytes None when over the limit. The bytes run from after the '[' or ',' before it.

    Scans bytes: JSON's structural characters are ASCII, and no byte of a multi-byte UTF-8 character
    is, so strings and nesting are followed without decoding anything.
    """
    depth, in_string, escaped, closed = 0, False, False, False
    element, size, start_line, oversize = bytearray(), 0, 1, False
    counted_to, line = 0, 1  # the line at byte counted_to of the current chunk
    line_start = 0  # where the current line starts, relative to the current chunk (negative: in an earlier chunk)
    raw_line, raw_column = 1, 0

    def begin(at: int) -> None:
        """An element's bytes start at ``at`` of the current chunk."""
        nonlocal start_line, raw_line, raw_column, line_start
        start_line = raw_line = line_at(at)
        newline = chunk.rfind(b"\n", 0, at)
        line_start = newline + 1 if newline >= 0 else line_start
        raw_column = at - line_start

    def line_at(at: int) -> int:
        nonlocal counted_to, line
        line += chunk.count(b"\n", counted_to, at)
        counted_to = at
        return line

    def add(part: bytes) -> None:
        nonlocal size, oversize, start_line
        if not bytes(element).strip() and not oversize:  # the element's first bytes: its line is where they start
            start_line += part[: len(part) - len(part.lstrip())].count(b"\n") if part.strip() else part.count(b"\n")
        size += len(part)
        if not oversize:
            if limit.max_bytes and size > limit.max_bytes:
                oversize = True
                element.clear()
            else:
                element.extend(part)

    with open(path, "rb") as f:
        chunk = f.read(_CHUNK).removeprefix(_BOM)
        while chunk:
            pos, segment = 0, None if depth == 0 else 0
            while pos < len(chunk):
                if escaped:
                    pos, escaped = pos + 1, False
                    continue
                if in_string:
                    found = _IN_STRING.search(chunk, pos)
                    if not found:
                        break
                    pos = found.end()
                    escaped, in_string = found.group() == b"\\", found.group() != b'"'
                    continue
                found = _STRUCTURE.search(chunk, pos)
                if not found:
                    break
                char, at, pos = found.group(), found.start(), found.end()
                if closed:
                    raise FtctlError(f"{path}:{line_at(at)}: text after the JSON array ends")
                if char == b'"':
                    in_string = True
                elif depth == 0:
                    if char != b"[" or chunk[:at].strip():
                        raise FtctlError(f"{path}:{line_at(at)}: malformed JSON: expected the array's '['")
                    depth, segment = 1, pos
                    begin(pos)
                elif char in b"[{":
                    depth += 1
                elif depth == 1 and char in b",]":
                    add(chunk[segment:at])
                    text = bytes(element).strip()
                    if text or oversize or char == b",":
                        yield start_line, raw_line, raw_column, None if oversize else bytes(element), size
                    element, size, oversize = bytearray(), 0, False
                    segment = pos
                    begin(pos)
                    if char == b"]":
                        depth, closed, segment = 0, True, None
                elif char in b"]}":
                    depth -= 1
            if segment is not None:
                add(chunk[segment:])
            elif closed and chunk[pos:].strip():
                raise FtctlError(f"{path}:{line_at(pos)}: text after the JSON array ends")
            line_at(len(chunk))
            newline = chunk.rfind(b"\n")
            line_start = (newline + 1 if newline >= 0 else line_start) - len(chunk)
            chunk, counted_to = f.read(_CHUNK), 0
    if not closed:
        raise FtctlError(f"{path}: malformed JSON: the array is not closed (the file may be cut short)")


def _iter_json_array(path: Path, limit: RecordLimit) -> Iterator[Record]:
    for index, (line, raw_line, raw_column, raw, size) in enumerate(_json_array_elements(path, limit)):
        where = f"{path}:item {index}"
        if raw is None:
            limit.over(size, f"{path}:{line} (item {index})")
            continue
        if not raw.strip():
            raise FtctlError(f"{path}:{line}: malformed JSON: an empty item (a comma too many?)")
        text = decode_utf8(raw, path, raw_line, raw_column)
        try:
            row = json.loads(text)
        except json.JSONDecodeError as exc:
            column = exc.colno + (raw_column if exc.lineno == 1 else 0)
            raise FtctlError(f"{path}:{raw_line + exc.lineno - 1}: malformed JSON: {exc.msg} (column {column}, item {index})") from None
        yield _as_record(row, where)


def _iter_parquet(path: Path, limit: RecordLimit) -> Iterator[Record]:
    import pyarrow.parquet as pq  # directly: datasets would copy the file into its cache

    index = 0
    for batch in pq.ParquetFile(path).iter_batches(batch_size=64):
        for row in batch.to_pylist():
            where = f"{path}:row {index}"
            index += 1
            if not limit.over(text_size(row), where):
                yield Record(row, where)


def text_size(value: Any) -> int:
    """About the bytes of a record's JSON text: what data.max_record_bytes limits for sources that are not JSON text."""
    if isinstance(value, str):
        return len(value)
    if isinstance(value, dict):
        return sum(len(str(k)) + 4 + text_size(v) for k, v in value.items()) + 2
    if isinstance(value, (list, tuple)):
        return sum(text_size(v) + 1 for v in value) + 2
    if isinstance(value, (bytes, bytearray)):
        return len(value)
    return len(str(value))


def _as_record(row: Any, source: str) -> Record:
    if not isinstance(row, dict):
        raise FtctlError(f"{source}: expected a JSON object, got {type(row).__name__}")
    return Record(row, source)
