"""Reading a user's text files: bytes that are not UTF-8 are one error naming file:line:column and the byte."""

from __future__ import annotations

from pathlib import Path

from ftctl.errors import FtctlError


def decode_utf8(raw: bytes, path, line: int = 1, column_offset: int = 0) -> str:
    """``raw`` (which starts at ``line``, column ``column_offset + 1``) as text."""
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        before = raw[: exc.start]
        line += before.count(b"\n")
        column = len(before[before.rfind(b"\n") + 1:].decode("utf-8", errors="replace")) + 1
        column += column_offset if b"\n" not in before else 0
        raise FtctlError(f"{path}:{line}:{column}: not valid UTF-8 (byte 0x{raw[exc.start]:02x}); save the file as UTF-8, "
                         "e.g. iconv -f latin1 -t utf-8 (if it is Latin-1)") from None


def read_utf8(path) -> str:
    """A whole text file (a byte order mark dropped)."""
    return decode_utf8(Path(path).read_bytes().removeprefix(b"\xef\xbb\xbf"), path)
