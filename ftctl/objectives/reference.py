"""The reference model of DPO and KTO: where its log-probabilities come from, and their on-disk cache.

- A **fresh adapter** (LoRA, DoRA, QLoRA without ``model.adapter``): the reference is the base model,
  which the training model already holds. Its sequences are scored by the training model itself with
  the adapter switched off (peft's ``disable_adapter``), through whatever wraps it (DDP, FSDP, ZeRO):
  no second copy of the weights.
- **Full fine-tuning, or an existing adapter** (``model.adapter``): the weights that training moves are
  the reference's own, so a frozen copy is loaded beside the model (weights in the compute dtype).
- ``objective.precompute_reference=true``: one pass before the first step scores every train and eval
  sequence with the reference and writes the results to ``$FTCTL_HOME/reference_cache/<key>.npy``;
  training then reads them from the batches, and no reference model stays in memory. The key hashes
  the tokenized data (so the tokenizer, template and max_seq_len too), the base model (its dir's
  config and weight files' names, sizes and times, or a hub id and revision), the adapter
  ``model.adapter`` starts from (its files' contents), the 4-bit quantisation of a QLoRA base and the
  compute precision: a change to any of them is a new entry, the same run again (or its resume) a hit.
  A run starting from step 0 scores with its own untrained model, so precomputing never loads a copy
  then; a resumed run that misses the cache loads one.

The ranks of a multi-process run share the pass: each scores an equal share of the examples (a
collective forward needs every rank to run the same number of them) and one all-reduce gives every
rank all the results.
"""

from __future__ import annotations

import contextlib
import gc
import hashlib
import json
import logging
import os
from pathlib import Path
from typing import Optional

import numpy as np
import torch

from ftctl.objectives.logprobs import sequence_logps
from ftctl.paths import ftctl_home

log = logging.getLogger("ftctl")

CACHE_DIR = "reference_cache"
_CACHE_VERSION = 1


class Reference:
    """Scores the sequences of a micro-batch under the reference model: (num_sequences,) fp32, no gradients."""

    kind = ""

    def sequence_logps(self, batch, device) -> torch.Tensor:
        raise NotImplementedError

    def release(self) -> None:
        """Free what only this reference holds."""


@contextlib.contextmanager
def _evaluating(module: torch.nn.Module):
    """No dropout while scoring; the module's own mode back afterwards."""
    training = module.training
    module.eval()
    try:
        yield
    finally:
        module.train(training)


class DisabledAdapter(Reference):
    """The training model with its (fresh) adapter switched off: the base model, with no second copy."""

    kind = "the training model with its adapter disabled"

    def __init__(self, module: torch.nn.Module, peft_model: torch.nn.Module):
        self.module, self.peft_model = module, peft_model

    def sequence_logps(self, batch, device):
        with torch.no_grad(), self.peft_model.disable_adapter(), _evaluating(self.module):
            return sequence_logps(self.module, batch, device)


class UntrainedPolicy(Reference):
    """The training model itself before its first step (precomputing only): it still is the reference."""

    kind = "the training model before its first step"

    def __init__(self, module: torch.nn.Module):
        self.module = module

    def sequence_logps(self, batch, device):
        with torch.no_grad(), _evaluating(self.module):
            return sequence_logps(self.module, batch, device)


class FrozenCopy(Reference):
    """A second model, loaded as the training model was and frozen: full fine-tuning, or an existing adapter."""

    kind = "a frozen copy of the starting model"

    def __init__(self, model: torch.nn.Module):
        self.model = model

    @classmethod
    def load(cls, method, model_path: str, precision, device, packing: bool, kernels: str) -> "FrozenCopy":
        """Built by the run's method (so with the run's attention and packed kernel), on the run's kernels."""
        from ftctl.models.kernels import use_kernels
        from ftctl.models.packed_attention import use_packed_attention
        from ftctl.training.loss import returns_head_output

        model = method.build_model(model_path, precision, device)
        model.requires_grad_(False)
        for param in model.parameters():  # nothing trains here: the compute dtype is enough (QLoRA's 4-bit codes stay)
            if param.dtype.is_floating_point and param.dtype != precision.frozen_weight_dtype():
                param.data = param.data.to(precision.frozen_weight_dtype())
        use_kernels(model, kernels)
        returns_head_output(model)
        if packing and method.attention is not None:
            use_packed_attention(model, method.attention.packed_kernel)
        return cls(model.eval())

    def sequence_logps(self, batch, device):
        with torch.no_grad():
            return sequence_logps(self.model, batch, device)

    def release(self):
        self.model = None
        gc.collect()


class Precomputed(Reference):
    """The log-probabilities the precompute pass attached to the data; the batches carry them."""

    kind = "precomputed log-probabilities"

    def sequence_logps(self, batch, device):
        return batch.reference_logps.to(device, non_blocking=True)


# ----------------------------------------------------------------------------------------------
# the cache


def _file_facts(path: Path) -> list:
    stat = path.stat()
    return [path.name, stat.st_size, stat.st_mtime_ns]


def base_model_fingerprint(model_path: str, revision: Optional[str] = None) -> str:
    """A local model dir by its config and its weight files' names, sizes and times (hashing gigabytes of weights
    would cost more than the pass it saves); a hub id by its name and revision."""
    path = Path(model_path)
    h = hashlib.sha256()
    if not path.is_dir():
        h.update(json.dumps([model_path, revision]).encode())
        return h.hexdigest()
    h.update(str(path.resolve()).encode())
    h.update((path / "config.json").read_bytes())
    weights = sorted(p for p in path.iterdir() if p.suffix in (".safetensors", ".bin", ".gguf") or p.name.endswith(".index.json"))
    h.update(json.dumps([_file_facts(p) for p in weights]).encode())
    return h.hexdigest()


def adapter_fingerprint(adapter_dir: Optional[str]) -> Optional[str]:
    """An adapter by the contents of its files (adapters are small)."""
    if not adapter_dir:
        return None
    from ftctl.methods.adapters import adapter_dir_of

    h = hashlib.sha256()
    for path in sorted(adapter_dir_of(adapter_dir).iterdir()):
        if path.is_file() and (path.suffix in (".safetensors", ".bin") or path.name == "adapter_config.json"):
            h.update(path.name.encode())
            h.update(path.read_bytes())
    return h.hexdigest()


def cache_key(data_fingerprint: str, cfg, model_path: str, precision_name: str) -> str:
    m = cfg.method
    quantization = [m.quant_type, m.double_quant, m.quant_storage] if m.name == "qlora" else None
    parts = {"v": _CACHE_VERSION, "data": data_fingerprint, "base": base_model_fingerprint(model_path, cfg.model.revision),
             "adapter": adapter_fingerprint(cfg.model.adapter), "quantization": quantization, "precision": precision_name}
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()[:32]


def cache_path(key: str) -> Path:
    return ftctl_home() / CACHE_DIR / f"{key}.npy"


def precompute_logps(reference: Reference, data, make_batches, backend, precision, micro_batch_size: int) -> np.ndarray:
    """Every example's two sequences scored by ``reference``, (examples, 2) float64, the same on every rank."""
    n, world = len(data), backend.world_size
    per_rank = -(-n // world)
    slots = [backend.rank + k * world for k in range(per_rank)]
    mine = [slot % n for slot in slots]  # wrapped round so every rank runs as many forwards; the repeats are not kept
    values = torch.zeros((n, 2), dtype=torch.float64)
    for j in range(0, per_rank, micro_batch_size):
        chunk = mine[j: j + micro_batch_size]
        kept = torch.tensor([slot < n for slot in slots[j: j + micro_batch_size]])
        (batch,) = make_batches(data, chunk)
        with precision.autocast():
            first = reference.sequence_logps(batch, backend.device).double().cpu()
            second = reference.sequence_logps(batch.kl, backend.device).double().cpu() if batch.kl is not None else None
        scores = first.view(-1, 2) if second is None else torch.stack([first, second], dim=1)
        index = torch.tensor(chunk)[kept]
        values[index] = scores[kept]
    return backend.all_reduce_sum(values).numpy()


def attach_reference_logps(datasets, *, cfg, model_path: str, precision, backend, make_batches, reference_factory) -> None:
    """Give each dataset its reference log-probs, from the cache or from one pass (then cached); collective."""
    reference = None
    try:
        for name, data in datasets:
            path = cache_path(cache_key(data.fingerprint(), cfg, model_path, precision.name))
            # Every rank must take the same branch: the pass is collective.
            everywhere = backend.all_reduce_sum(torch.tensor(float(path.is_file()))) == backend.world_size
            if everywhere:
                data.reference_logps = np.load(path)
                if backend.is_main:
                    log.info("reference log-probs of the %s data: cache hit (%s)", name, path)
                continue
            if reference is None:
                reference = reference_factory()
            if backend.is_main:
                log.info("reference log-probs of the %s data: cache miss; scoring %d examples with %s", name, len(data), reference.kind)
            data.reference_logps = precompute_logps(reference, data, make_batches, backend, precision, cfg.train.micro_batch_size)
            if backend.is_main:
                path.parent.mkdir(parents=True, exist_ok=True)
                tmp = path.with_name(f"{path.stem}.{os.getpid()}.tmp.npy")
                np.save(tmp, data.reference_logps)
                os.replace(tmp, path)
                log.info("reference log-probs cached in %s", path)
            backend.barrier()
    finally:
        if reference is not None:
            reference.release()
