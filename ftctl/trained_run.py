"""What a finished or running ftctl run left on disk that later commands read back: its resolved
config (config.yaml) and, from it, the attention kernel and system prompt it trained with.

It sits low (it needs only the config layer) so that model loading, merge, eval, chat and export
all read a run the same way without importing one another.
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

from ftctl.config.schema import ModelConfig
from ftctl.errors import FtctlError


def trained_run_config(*targets: Optional[str]):
    """The resolved config of the ftctl run that produced the first of ``targets`` that is a run result, or None.

    A target is a run dir, its final/ or a checkpoints/step-N/ dir.
    """
    from ftctl.config.compose import load_resolved

    for target in filter(None, targets):
        path = Path(target).expanduser()
        for run_dir in (path, path.parent, path.parent.parent):
            if (run_dir / "config.yaml").is_file() and ((run_dir / "final").is_dir() or (run_dir / "checkpoints").is_dir()):
                try:
                    return load_resolved(run_dir / "config.yaml")
                except FtctlError:
                    return None
    return None


def trained_system_prompt(*targets: Optional[str]) -> Optional[str]:
    """The data.system_prompt of the ftctl run that produced a result, read from the run's config.yaml; None for anything else.

    A model trained with a system prompt answers as trained only when it sees that prompt again.
    """
    run = trained_run_config(*targets)
    return run.data.system_prompt if run is not None else None


def trained_model_config(name_or_path: str, result: Optional[str]) -> ModelConfig:
    """How to load ``name_or_path`` for a run ``result`` (adapter, run or output dir): with the attention kernel
    that run trained with (its config.yaml), so merge, eval, chat, generate and export see the model training saw.
    Anything else loads with the defaults (``auto``)."""
    run = trained_run_config(result)
    # These commands load on the CPU first; a GPU-only kernel (flash-attention) is left to auto there.
    if run is None or run.model.attn_implementation not in ("sdpa", "eager"):
        return ModelConfig(name_or_path=name_or_path)
    return ModelConfig(name_or_path=name_or_path, attn_implementation=run.model.attn_implementation)
