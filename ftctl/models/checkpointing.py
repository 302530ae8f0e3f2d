"""Activation (gradient) checkpointing of all decoder layers or of every k-th one.

A checkpointed layer keeps only its input in forward and runs its forward again in backward; the
others keep their activations. Checkpointing every k-th layer (layers 0, k, 2k, ...) holds about
``1/k`` of the checkpointed layers' inputs plus ``(k-1)/k`` of the layers' full activations: memory
traded back for the recompute time of the layers left out. The layers are transformers'
``GradientCheckpointingLayer`` blocks, whatever the family calls them.
"""

from __future__ import annotations

from typing import List

import torch


def checkpointable_layers(model: torch.nn.Module) -> List[torch.nn.Module]:
    """The blocks transformers can checkpoint, in the model's order."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    return [m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)]


def enable_activation_checkpointing(model: torch.nn.Module, every: int = 1) -> List[int]:
    """Checkpoint decoder layers 0, ``every``, 2 × ``every``, ...; returns the indices of the checkpointed layers."""
    # activation_checkpointing_enable is the newer name; a peft model answers for its base model.
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    checkpointed = []
    for index, layer in enumerate(checkpointable_layers(model)):
        layer.gradient_checkpointing = index % every == 0
        if layer.gradient_checkpointing:
            checkpointed.append(index)
    return checkpointed
