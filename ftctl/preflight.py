"""What `ftctl train` checks after the config validated and before it writes or starts anything.

Torch-free, so ``--dry-run`` runs the same checks as a real run: the files the config names, the
method × backend × precision × device combination, and the rules of multi-node launches. The GPU
probe here tells which device a run would get; what ``precision=auto`` means there is
:mod:`ftctl.precision.auto`'s.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Optional, Sequence

from ftctl.config.schema import RunConfig
from ftctl.errors import ConfigError


def check_files(cfg: RunConfig, *, check_hub: bool = True) -> None:
    """Cheap checks of the files a run needs and the dirs it writes, so a typo fails before anything is written.

    ``check_hub`` also asks whether a hub model or dataset can load here (a plan may be meant for another machine).
    """
    from ftctl.models.aliases import is_alias
    from ftctl.models.loading import resolve_model_path

    if not is_alias(cfg.model.name_or_path):
        resolve_model_path(cfg.model.name_or_path, check_hub=check_hub)
    from ftctl.data.sources import locate_all

    locate_all(cfg.data, check_hub=check_hub)
    from ftctl.paths import check_output_path

    check_output_path(Path(cfg.output_dir), "output_dir", directory=True)
    if cfg.data.cache_dir:
        check_output_path(Path(cfg.data.cache_dir), "data.cache_dir", directory=True)


def check_launch(cfg: RunConfig, overrides: Sequence[str], device_type: Optional[str] = None) -> None:
    """What must hold for this run on this machine (``device_type`` 'cuda' or 'cpu'; None asks torch)."""
    from ftctl.parallel.place import inside_launcher
    from ftctl.parallel.support import check_supported

    check_supported(cfg, device_type)
    from ftctl.training.trackers import missing_packages, requested_trackers

    missing = missing_packages(requested_trackers(cfg.train))
    if missing:
        raise ConfigError(f"train.report_to: {', '.join(missing)} is not installed; pip install 'ftctl[track]', or remove it from train.report_to")
    if cfg.parallel.nnodes > 1 and not inside_launcher() and not any(o.startswith("output_dir=") for o in overrides):
        raise ConfigError(
            "a multi-node run needs an explicit output_dir=... on every node (on a filesystem they share): "
            "the default, timestamped one would differ from node to node"
        )


def gpu_visible() -> bool:
    """Whether torch would find a GPU here, told without importing it: NVIDIA's driver lists one, or a
    ROCm (/dev/kfd) or WSL2 (/dev/dxg) GPU device exists, and CUDA_VISIBLE_DEVICES does not hide them."""
    if os.environ.get("CUDA_VISIBLE_DEVICES", None) == "":
        return False
    gpus = Path("/proc/driver/nvidia/gpus")
    return (gpus.is_dir() and any(gpus.iterdir())) or os.path.exists("/dev/kfd") or os.path.exists("/dev/dxg")


def visible_device_type() -> str:
    """The device a run here would train on, as far as it can be told without importing torch."""
    return "cuda" if gpu_visible() else "cpu"
