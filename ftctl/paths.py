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
