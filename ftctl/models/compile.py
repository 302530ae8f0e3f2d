"""Regional compilation (``train.compile``): each decoder layer compiled on its own, not the whole model.

The layers of a decoder are identical, so compiling one layer's code serves them all: compile time
is that of one layer, not of the whole model, and what does not trace (the loss, peft's wrappers,
the packing boundaries) stays eager between the layers. ``Module.compile`` compiles in place, so
parameter names, checkpoints and wrappers see the same modules as without it.
"""

from __future__ import annotations

from typing import List

import torch

#: torch.compile's backend; tests swap in "eager" (the same graph capture, no code generation).
COMPILE_BACKEND = "inductor"


def decoder_layers(model: torch.nn.Module) -> List[torch.nn.Module]:
    """The repeated blocks of a causal LM: the longest ``ModuleList`` named ``layers`` (or ``h``, ``blocks``)."""
    candidates = [
        module for name, module in model.named_modules()
        if isinstance(module, torch.nn.ModuleList) and name.rsplit(".", 1)[-1] in ("layers", "h", "blocks")
    ]
    return list(max(candidates, key=len)) if candidates else []


def compile_decoder_layers(model: torch.nn.Module) -> int:
    """Compile every decoder layer of ``model`` in place; returns how many."""
    layers = decoder_layers(model)
    for layer in layers:
        # Packed micro-batches differ in shape from one to the next: dynamic shapes from the start
        # instead of one recompilation per new length.
        layer.compile(dynamic=True, backend=COMPILE_BACKEND)
    return len(layers)
