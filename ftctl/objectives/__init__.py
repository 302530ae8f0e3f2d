"""Training objectives behind one interface (:class:`ftctl.objectives.base.Objective`): what the loss asks for.

``sft`` is next-token cross-entropy; ``dpo`` (sigmoid, ipo, hinge, robust), ``simpo`` and ``orpo`` compare
the two answers of a preference pair; ``kto`` scores labelled answers one by one
(:mod:`ftctl.objectives.preference`). Each composes with every method, backend and precision: the
runner's loop does not branch on it.
"""

from __future__ import annotations

from ftctl.config.schema import RunConfig
from ftctl.objectives.base import Objective


def create_objective(cfg: RunConfig) -> Objective:
    name = cfg.objective.name
    if name == "sft":
        from ftctl.objectives.base import SFT

        return SFT(cfg)
    from ftctl.objectives.preference import KTO, PreferenceObjective

    return KTO(cfg) if name == "kto" else PreferenceObjective(cfg)
