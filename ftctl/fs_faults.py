"""Faults of the machine rather than of ftctl: a full disk, a file-size limit, a read-only or forbidden
directory, a network mount that went away. Each becomes one line naming the path and the fix.

Libraries do not always say which fault they hit: safetensors reports ``(os error 28)`` inside its
own exception type, and ``torch.save`` only says that its writer failed. :func:`fault_errno` reads
the errno where there is one and otherwise asks the file system what went wrong (free space, the
file-size limit, a read-only mount, write permission, a stale mount). Torch-free.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import resource
import shutil
from pathlib import Path
from typing import Callable, Iterator, Optional

from ftctl.errors import FtctlError

NO_SPACE = {errno.ENOSPC, errno.EDQUOT}
READ_ONLY = {errno.EROFS}
FORBIDDEN = {errno.EACCES, errno.EPERM}
#: What a network file system that went away answers (NFS: stale handle; FUSE: not connected; CIFS: host down).
LOST_MOUNT = {errno.ESTALE, errno.ENOTCONN, errno.EHOSTDOWN, errno.ENODEV, errno.EIO, errno.ENXIO, errno.ETIMEDOUT}
FAULTS = NO_SPACE | READ_ONLY | FORBIDDEN | LOST_MOUNT | {errno.EFBIG}

_OS_ERROR = re.compile(r"\(os error (\d+)\)|\[Errno (\d+)\]|errno[ =:]+(\d+)", re.I)


class FilesystemFault(FtctlError):
    """The disk, a limit or a mount stopped a write or read; the message names the path and the fix."""


def fault_errno(exc: BaseException, path: Optional[Path] = None) -> Optional[int]:
    """The errno of a fault in FAULTS behind ``exc`` (or its causes), else what ``path``'s file system shows; None otherwise."""
    seen = exc
    while seen is not None:
        code = getattr(seen, "errno", None)
        if code is None:
            match = _OS_ERROR.search(str(seen))
            code = int(next(g for g in match.groups() if g)) if match else None
        if code in FAULTS:
            return code
        seen = seen.__cause__ or seen.__context__
    return diagnose(path) if path is not None else None


def diagnose(path: Path) -> Optional[int]:
    """Why a write under ``path`` may have failed when the library would not say: the first fault that holds now."""
    try:
        where = existing_ancestor(Path(path))
        stats = os.statvfs(where)
    except OSError as exc:
        return exc.errno if exc.errno in LOST_MOUNT else None
    if stats.f_flag & os.ST_RDONLY:
        return errno.EROFS
    if stats.f_bavail * stats.f_frsize < 1 << 20:  # under 1 MiB left: a write of any checkpoint file fails
        return errno.ENOSPC
    size_limit = file_size_limit()
    if size_limit is not None and _largest_file(Path(path)) >= size_limit:
        return errno.EFBIG
    if not os.access(where, os.W_OK):
        return errno.EACCES
    return None


def _largest_file(path: Path) -> int:
    if path.is_file():
        return path.stat().st_size
    sizes = [p.stat().st_size for p in path.rglob("*") if p.is_file()] if path.is_dir() else []
    return max(sizes, default=0)


def existing_ancestor(path: Path) -> Path:
    path = Path(path).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_bytes(path: Path) -> Optional[int]:
    try:
        return shutil.disk_usage(existing_ancestor(path)).free
    except OSError:
        return None


def file_size_limit() -> Optional[int]:
    soft, _ = resource.getrlimit(resource.RLIMIT_FSIZE)
    return None if soft == resource.RLIM_INFINITY else soft


def human_bytes(n: Optional[float]) -> str:
    if n is None:
        return "an unknown amount"
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "bytes" else f"{n:.1f} {unit}"
        n /= 1024
    return f"{n:.1f} TiB"


def fault_message(code: int, path: Path, what: str, needed: Optional[int] = None) -> str:
    """One line: what could not be written (or read) where, why, and what to do."""
    path = Path(path)
    if code in NO_SPACE:
        quota = " (disk quota exceeded)" if code == errno.EDQUOT else ""
        need = f"needs about {human_bytes(needed)}" if needed else "needs more space"
        return (f"no space left on the device of {path}{quota}: {what} {need}, {human_bytes(free_bytes(path))} free; "
                "free some space or choose another output_dir (nothing was left half-written)")
    if code == errno.EFBIG:
        limit = file_size_limit()
        limit_text = f"{human_bytes(limit)} ({limit} bytes)" if limit is not None else "a file system limit"
        need = f" needs about {human_bytes(needed)};" if needed else ""
        return (f"{path}: a file of {what} exceeds the file-size limit, {limit_text};{need} raise it (`ulimit -f unlimited`) "
                "or ask the admin; nothing was left half-written")
    if code in READ_ONLY:
        return f"{path} is on a read-only file system, so {what} cannot be written; choose a writable output_dir or remount it read-write"
    if code in FORBIDDEN:
        return f"{path}: permission denied writing {what}; choose a directory you can write to, or fix its owner or mode"
    reason = os.strerror(code)
    return (f"{path}: the file system is gone ({reason}; a network mount lost?) while handling {what}; remount it, then "
            "continue with resume=auto: checkpoints written before are unaffected")


@contextlib.contextmanager
def writing(path: Path, what: str, needed: Optional[int] = None, cleanup: Optional[Callable[[], None]] = None,
            shown: Optional[Path] = None) -> Iterator[None]:
    """Turn a fault while writing ``what`` under ``path`` into one FilesystemFault naming ``shown`` (default ``path``);
    ``cleanup`` first removes the partial output, so that nothing half-written stays. Other errors pass through
    (cleanup runs for them too)."""
    try:
        yield
    except FtctlError:
        if cleanup is not None:
            cleanup()
        raise
    except Exception as exc:
        code = fault_errno(exc, path)  # before the cleanup: a file cut at the size limit tells that limit apart
        if cleanup is not None:
            with contextlib.suppress(Exception):
                cleanup()
        if code is None:
            raise
        raise FilesystemFault(fault_message(code, shown or path, what, needed)) from exc


def os_error_line(exc: OSError) -> Optional[str]:
    """The one line for an OSError nothing caught on its way up (None when it is not a machine fault)."""
    code = exc.errno
    if code not in FAULTS:
        return None
    target = exc.filename or "a file"
    return fault_message(code, Path(target), "a file" if exc.filename is None else "it")
