"""Where ftctl finds its recipe tree, bundled samples and cache, installed or in a checkout."""

from __future__ import annotations

import os
from pathlib import Path

_PACKAGE_DIR = Path(__file__).resolve().parent


def recipes_dir() -> Path:
    """The Hydra recipe tree: inside the wheel as ftctl/_recipes, at the top of a checkout as recipes/."""
    for candidate in (_PACKAGE_DIR / "_recipes", _PACKAGE_DIR.parent / "recipes"):
        if (candidate / "config.yaml").is_file():
            return candidate
    raise FileNotFoundError("ftctl's recipe tree is missing from this installation; reinstall ftctl.")


def model_configs_dir() -> Path:
    return recipes_dir() / "model_configs"


def samples_dir() -> Path:
    import data_formats

    return Path(data_formats.__file__).resolve().parent / "samples"


def ftctl_home() -> Path:
    """Cache root for converted models and tokenized data: $FTCTL_HOME, else ~/.cache/ftctl."""
    return Path(os.environ.get("FTCTL_HOME") or Path.home() / ".cache" / "ftctl").expanduser()


def check_output_path(path: Path, key: str, *, directory: bool = False) -> None:
    """Refuse, in one line and before any work, an output that cannot be written: ``path`` (a file, or a
    dir with ``directory``) is the wrong kind, or the nearest existing folder above it is a file or not
    writable. Missing folders above it are fine: :func:`make_parent` creates them."""
    from ftctl.errors import FtctlError
    from ftctl.fs_faults import existing_ancestor

    path = Path(path).expanduser()
    if path.exists() and path.is_dir() != directory:
        raise FtctlError(f"{key}={path} is {'a file' if directory else 'a directory'}; give the path of "
                         f"{'a directory' if directory else 'a file to write'}")
    ancestor = existing_ancestor(path.parent)
    if not ancestor.is_dir():
        raise FtctlError(f"{key}={path}: {ancestor} is a file, so no folder can be made under it")
    if not os.access(ancestor, os.W_OK | os.X_OK):
        read_only = bool(os.statvfs(ancestor).f_flag & os.ST_RDONLY)
        why = "it is on a read-only file system; remount it read-write or choose another" if read_only else "permission denied"
        raise FtctlError(f"{key}={path}: cannot write in {ancestor} ({why})")


def make_parent(path: Path, key: str) -> Path:
    """Create the folders above ``path`` (as mkdir -p does); return ``path``. A failure is one line naming ``key``."""
    from ftctl.errors import FtctlError

    path = Path(path).expanduser()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise FtctlError(f"{key}={path}: cannot create the folder {path.parent} ({exc.strerror or exc})") from None
    return path
