"""The run directory: refused when it holds another run, then stamped with the resolved config."""

from __future__ import annotations

from pathlib import Path

from ftctl.config.compose import to_yaml
from ftctl.config.schema import RunConfig
from ftctl.errors import FtctlError

CONFIG_FILE = "config.yaml"


def prepare_run_dir(cfg: RunConfig) -> Path:
    run_dir = Path(cfg.output_dir).expanduser()
    if run_dir.exists() and any(run_dir.iterdir()) and not cfg.overwrite:
        raise FtctlError(
            f"output_dir {run_dir} is not empty; choose another output_dir, or pass overwrite=true to train into it"
        )
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in ("metrics.jsonl",):
        (run_dir / stale).unlink(missing_ok=True)
    (run_dir / CONFIG_FILE).write_text(to_yaml(cfg))
    return run_dir
