"""Fine-tuning methods behind one interface: how the model is built, what trains, what is saved.

``full`` trains every weight. ``lora`` adds low-rank adapters; ``dora`` and ``qlora`` are the same
adapter method with DoRA's magnitude vectors or a 4-bit base (see :mod:`ftctl.methods.adapters`).
"""

from __future__ import annotations

from ftctl.config.schema import RunConfig
from ftctl.methods.base import Method


def create_method(cfg: RunConfig, attention=None) -> Method:
    """``attention``: the run's :func:`ftctl.models.loading.attention_for_run`, which the model loads with."""
    if cfg.method.name == "full":
        from ftctl.methods.full import FullFineTuning

        return FullFineTuning(cfg, attention)
    from ftctl.methods.adapters import AdapterMethod, QuantizedAdapterMethod

    return QuantizedAdapterMethod(cfg, attention) if cfg.method.name == "qlora" else AdapterMethod(cfg, attention)
