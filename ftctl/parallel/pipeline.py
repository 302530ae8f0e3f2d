"""Pipeline parallelism with torch.distributed.pipelining: stages cut at decoder-layer boundaries, torch's schedules.

A stage is the model itself with what it does not hold turned into identities: the layers of other
stages, and the embeddings (all but the first stage), the final norm and the head (all but the
last). So every stage runs the model family's own forward (its masks, rotary embeddings, layer
kinds), the first from token ids, the others from the hidden states the previous stage sent
(``inputs_embeds``); the last one computes the loss with ftctl's own head loss. The model object
keeps every parameter name: the parts this rank does not hold move to the meta device (no
memory), so saving, resuming and the method's view of what trains work by the same names as in
one process.

Each stage's module is a shallow copy of the model along the paths that differ (the layer list,
the replaced modules); the layers themselves are shared, so sharding them (TP, FSDP) shards the
stage. Interleaved 1F1B gives a rank several such stages.
"""

from __future__ import annotations

import copy
from typing import Dict, List, Sequence

import torch

from ftctl.data.render import IGNORE_INDEX
from ftctl.errors import FtctlError
from ftctl.parallel.mesh_shape import rank_stages, stage_layer_ranges


class Skipped(torch.nn.Module):
    """Stands in for a part of the model another stage holds: passes its first input through."""

    def forward(self, *args, **kwargs):
        return args[0] if args else next(iter(kwargs.values()))


def decoder_layer_list(model: torch.nn.Module):
    """(qualified name, ModuleList) of the model's decoder layers."""
    from ftctl.parallel.fsdp import decoder_layers

    first = decoder_layers(model)[0]
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.ModuleList) and any(child is first for child in module):
            return name, module
    raise FtctlError(f"{type(model).__name__}: no list of decoder layers to cut into pipeline stages")


def _names(model: torch.nn.Module) -> Dict[int, str]:
    return {id(module): name for name, module in model.named_modules(remove_duplicate=False)}


def shell(root: torch.nn.Module, replace: Dict[str, torch.nn.Module]) -> torch.nn.Module:
    """A copy of ``root`` sharing every module except those named in ``replace`` (dotted names), which are swapped."""
    new_root = copy.copy(root)
    new_root._modules = dict(root._modules)
    copied = {id(new_root)}
    for name, replacement in replace.items():
        node = new_root
        *path, leaf = name.split(".")
        for part in path:
            child = node._modules[part]
            if id(child) not in copied:
                child = copy.copy(child)
                child._modules = dict(child._modules)
                copied.add(id(child))
                node._modules[part] = child
            node = child
        node._modules[leaf] = replacement
    return new_root


class StageModule(torch.nn.Module):
    """One pipeline stage: (token ids or hidden states, attention mask, next-token targets) -> hidden states or loss sum."""

    def __init__(self, model: torch.nn.Module, index: int, num_stages: int):
        super().__init__()
        self.model, self.index = model, index
        self.is_first, self.is_last = index == 0, index == num_stages - 1

    def forward(self, x, attention_mask, targets):
        inputs = {"input_ids" if self.is_first else "inputs_embeds": x, "attention_mask": attention_mask, "use_cache": False}
        if not self.is_last:
            return self.model(**inputs).logits  # the head and final norm are Skipped: the last hidden state
        from ftctl.training.loss import loss_sum_for_targets

        return loss_sum_for_targets(self.model, inputs, targets)


def cut_stages(model: torch.nn.Module, pp_rank: int, pp_size: int, per_rank: int) -> List[StageModule]:
    """This rank's stages of ``model``; what the rank does not hold moves to the meta device."""
    list_name, layers = decoder_layer_list(model)
    num_stages = pp_size * per_rank
    if num_stages > len(layers):
        raise FtctlError(f"parallel.pp_size: {num_stages} pipeline stages for {len(layers)} decoder layers; use at most {len(layers)}")
    ranges = stage_layer_ranges(len(layers), num_stages)
    mine = rank_stages(pp_rank, pp_size, per_rank)
    names = _names(model)
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    embeddings, head = base.get_input_embeddings(), base.get_output_embeddings()
    decoder = next(m for m in base.modules() if any(c is layers for c in m.children()))
    norm = getattr(decoder, "norm", None)  # the final norm, where the family has one under that name
    edges = {"embeddings": [names[id(embeddings)]], "norm": [names[id(norm)]] if norm is not None else [],
             "head": [names[id(head)]] if head is not None else []}
    owned_layers = {i for s in mine for i in ranges[s]}
    stages = []
    for s in mine:
        replace = {f"{list_name}.{i}": Skipped() for i in range(len(layers)) if i not in ranges[s]}
        if s != 0:
            replace.update({n: Skipped() for n in edges["embeddings"]})
        if s != num_stages - 1:
            replace.update({n: Skipped() for n in edges["norm"] + edges["head"]})
        stages.append(StageModule(shell(model, replace), s, num_stages))
    # Free what no stage of this rank holds; tied embeddings stay wherever the head or the embedding is held.
    held = set()
    for stage in stages:
        held.update(id(p) for p in stage.parameters())
    for i, layer in enumerate(layers):
        if i not in owned_layers:
            release(layer)
    for module in (embeddings, norm, head):
        if module is not None and not any(id(p) in held for p in module.parameters()):
            release(module)
    return stages


def release(module: torch.nn.Module) -> None:
    """Replace ``module``'s tensors by meta tensors of the same names, shapes and requires_grad (frees their memory).

    Parameter by parameter rather than ``module.to("meta")``: bitsandbytes' 4-bit parameters cannot be moved there.
    """
    for sub in module.modules():
        for name, param in list(sub._parameters.items()):
            if param is not None:
                meta = torch.empty(param.shape, dtype=param.dtype, device="meta")
                sub._parameters[name] = torch.nn.Parameter(meta, requires_grad=param.requires_grad)
        for name, buffer in list(sub._buffers.items()):
            if buffer is not None:
                sub._buffers[name] = torch.empty(buffer.shape, dtype=buffer.dtype, device="meta")


def pad_to(t: torch.Tensor, rows: int, width: int, value) -> torch.Tensor:
    """``t`` padded to ``rows × width`` with ``value``."""
    out = t.new_full((rows, width), value)
    out[: t.shape[0], : t.shape[1]] = t
    return out


def pipeline_inputs(batches: Sequence, rows: int, width: int, pad_token_id: int):
    """One (ids, attention mask, next-token targets) tensor each for the whole step, every micro-batch ``rows × width``.

    Pipeline stages exchange activations of one fixed shape, so micro-batches are right-padded to
    ``data.max_seq_len`` (and to ``rows`` rows; an added row attends to its first token only and
    trains nothing). Padding is masked from attention and loss, so the loss is the same.
    """
    from ftctl.training.loss import next_token_targets

    ids, masks, targets = [], [], []
    for batch in batches:
        if batch.input_ids.shape[1] > width:
            raise FtctlError(f"a micro-batch of {batch.input_ids.shape[1]} tokens exceeds data.max_seq_len={width}")
        ids.append(pad_to(batch.input_ids, rows, width, pad_token_id))
        mask = pad_to(batch.attention_mask, rows, width, 0)
        mask[batch.input_ids.shape[0]:, 0] = 1
        masks.append(mask)
        targets.append(pad_to(next_token_targets(batch.labels), rows, width, IGNORE_INDEX))
    return torch.cat(ids), torch.cat(masks), torch.cat(targets)


SCHEDULES = {"gpipe": "ScheduleGPipe", "1f1b": "Schedule1F1B", "interleaved_1f1b": "ScheduleInterleaved1F1B"}


def build_schedule(name: str, stages: list, microbatches: int, loss_fn):
    """torch's schedule over this rank's PipelineStages; gradients are not rescaled (ftctl normalises by tokens)."""
    from torch.distributed import pipelining

    schedule = getattr(pipelining, SCHEDULES[name])
    if name == "interleaved_1f1b":
        return schedule(stages, microbatches, loss_fn=loss_fn, scale_grads=False)
    return schedule(stages[0], microbatches, loss_fn=loss_fn, scale_grads=False)
