"""What autograd keeps for backward in each decoder layer of the runner's own model setup (packed batch,
fused norms and LoRA, per-example SDPA): the estimator's activation counts are checked against it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Tuple

import torch


@dataclass
class SavedByLayer:
    layers: List[Dict[int, Tuple[int, torch.dtype]]]  # per layer: storage pointer -> (bytes, dtype)
    tokens: int  # positions in the packed batch
    model: torch.nn.Module

    def bytes_per_layer(self) -> List[int]:
        return [sum(n for n, _ in layer.values()) for layer in self.layers]

    def dtypes_per_layer(self) -> List[set]:
        return [{dtype for _, dtype in layer.values()} for layer in self.layers]


def saved_by_decoder_layer(cfg) -> SavedByLayer:
    """One packed forward in the precision ``cfg`` names; each layer's saved tensors, as distinct
    storages that are neither parameters nor the layer's own inputs."""
    from ftctl.data.batching import pack_examples
    from ftctl.methods import create_method
    from ftctl.models.fast_rms_norm import use_fast_rms_norm
    from ftctl.models.packed_attention import use_packed_attention
    from ftctl.precision.policy import resolve_precision

    cpu = torch.device("cpu")
    precision = resolve_precision(cfg.precision, cpu)
    model = create_method(cfg).build_model(cfg.model.name_or_path, precision, cpu)
    use_fast_rms_norm(model)
    assert use_packed_attention(model)
    model.train()
    batch = pack_examples([(list(range(1, n + 1)), list(range(1, n + 1))) for n in (40, 24, 60, 4)], 64, 0)
    parameters = {p.untyped_storage().data_ptr() for p in model.parameters()}
    layers = [m for m in model.modules() if type(m).__name__ == "LlamaDecoderLayer"]
    saved = {i: [] for i in range(len(layers))}
    inputs = {i: set() for i in range(len(layers))}

    def watch(i, layer):
        hooks = torch.autograd.graph.saved_tensors_hooks(lambda t: saved[i].append(t) or t, lambda t: t)

        def enter(module, args, kwargs):
            flat = list(args) + list(kwargs.values()) + list(kwargs.get("position_embeddings") or ())
            inputs[i].update(t.untyped_storage().data_ptr() for t in flat if isinstance(t, torch.Tensor))
            hooks.__enter__()

        layer.register_forward_pre_hook(enter, with_kwargs=True)
        layer.register_forward_hook(lambda *_: hooks.__exit__(None, None, None))

    for i, layer in enumerate(layers):
        watch(i, layer)
    with precision.autocast():
        model(**batch.model_inputs("cpu", packed_kernel="sdpa"))
    kept = []
    for i in range(len(layers)):
        storages = {t.untyped_storage().data_ptr(): (t.untyped_storage().nbytes(), t.dtype) for t in saved[i]}
        kept.append({ptr: v for ptr, v in storages.items() if ptr not in parameters and ptr not in inputs[i]})
    return SavedByLayer(kept, batch.input_ids.numel(), model)
