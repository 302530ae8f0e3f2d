"""One writer per run dir: an exclusive lock that the process owning the run holds for the run's whole life.

The lock is ``flock`` on ``<run dir>/.ftctl-lock``. The kernel releases it however the holder ends
(``kill -9`` included), and on Linux NFS it is a lock the server keeps, so a job on another node sees
it too. The file names the holder (PID, host, start time) for the message a second run gets; a file
naming a holder whose lock is gone is a stale lock, taken over with a notice. On a file system
without locks, the holder's PID is checked instead, which can be done only on the same host.

Torch-free: ``ftctl train`` takes the lock before anything in the run dir changes.
"""

from __future__ import annotations

import contextlib
import errno
import json
import logging
import os
import socket
import time
from pathlib import Path
from typing import Dict, Optional

from ftctl.errors import FtctlError

try:
    import fcntl
except ImportError:  # not a POSIX system: the PID check alone
    fcntl = None

LOCK_FILE = ".ftctl-lock"
log = logging.getLogger("ftctl")

_held: Dict[Path, int] = {}  # run dir -> the open lock file's descriptor, in this process


class RunDirLocked(FtctlError):
    """Another process writes this run dir."""


def _holder_text() -> str:
    return json.dumps({"pid": os.getpid(), "host": socket.gethostname(), "since": time.strftime("%Y-%m-%d %H:%M:%S")})


def _read_holder(fd: int) -> Optional[dict]:
    raw = os.pread(fd, 4096, 0)
    try:
        holder = json.loads(raw) if raw.strip() else None
    except ValueError:
        return None
    return holder if isinstance(holder, dict) else None


def _describe(holder: Optional[dict]) -> str:
    if not holder:
        return "another process"
    return f"PID {holder.get('pid')} on {holder.get('host')} (since {holder.get('since')})"


def holds_lock(run_dir: Path) -> bool:
    return Path(run_dir).resolve() in _held


def acquire(run_dir: Path) -> bool:
    """Take the run dir's lock for this process; True when this call took it, False when this process already held it.

    Raises RunDirLocked naming the holder when another live process has it.
    """
    key = Path(run_dir).resolve()
    if key in _held:
        return False
    fd = os.open(key / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        stale = _lock(fd, key)
        if stale:
            log.warning("run dir %s: took over the lock of %s, which is no longer running", key, _describe(stale))
        os.ftruncate(fd, 0)
        os.pwrite(fd, _holder_text().encode(), 0)
        os.fsync(fd)
    except BaseException:
        os.close(fd)
        raise
    _held[key] = fd
    return True


def _lock(fd: int, run_dir: Path) -> Optional[dict]:
    """Lock ``fd``; returns the previous holder when it left a stale lock behind, raises when one is alive."""
    holder = _read_holder(fd)
    if fcntl is not None:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise RunDirLocked(
                f"output_dir {run_dir} is in use by another ftctl run: {_describe(_read_holder(fd))}; wait for it to "
                "finish or stop it (it saves a checkpoint on SIGTERM), or choose another output_dir"
            ) from None
        except OSError as exc:
            if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
        else:
            return holder if holder and holder.get("pid") != os.getpid() else None
    # No locks on this file system: the holder's PID is all there is to go by.
    if holder and holder.get("pid") != os.getpid():
        if holder.get("host") != socket.gethostname():
            raise RunDirLocked(
                f"output_dir {run_dir} is marked in use by {_describe(holder)}, and its file system has no locks to tell "
                f"whether that run still lives; if it has ended, delete {run_dir / LOCK_FILE} and start again"
            )
        if process_alive(int(holder.get("pid", 0))):
            raise RunDirLocked(f"output_dir {run_dir} is in use by another ftctl run: {_describe(holder)}; wait for it "
                               "to finish or stop it, or choose another output_dir")
        return holder
    return None


def process_alive(pid: int) -> bool:
    if pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def release(run_dir: Path) -> None:
    """Give the lock up (clearing the holder's name first, so nobody takes this process for a stale holder)."""
    fd = _held.pop(Path(run_dir).resolve(), None)
    if fd is None:
        return
    with contextlib.suppress(OSError):
        os.ftruncate(fd, 0)
    os.close(fd)


def release_all() -> None:
    for run_dir in list(_held):
        release(run_dir)
