"""``parallel=mesh``: one torch DeviceMesh with named axes, each axis applied by torch's or transformers' own engine.

The mesh is ``pp × dp_replicate × dp_shard × tp`` (:mod:`ftctl.parallel.mesh_shape`), with the
expert axis ``ep`` carved out of ``dp_shard × tp``. :meth:`MeshBackend.parallelize` applies the
axes in torchtitan's order, each a small step on a library's API:

1. pipeline: cut the model into this rank's stages at decoder-layer boundaries
   (:mod:`ftctl.parallel.pipeline`, run by torch.distributed.pipelining's schedules);
2. tensor parallel: the model's own plan with peft's LoRA rule (:mod:`ftctl.parallel.tensor_parallel`);
3. expert parallel: the model's own expert plan (transformers' token dispatch);
4. activation checkpointing, then 5. regional compilation;
6. FSDP2 ``fully_shard`` over the data-parallel axes (HSDP when dp_replicate > 1), experts over
   the ranks that share them.

Every method runs under every mesh its engines allow (refusals: :mod:`ftctl.parallel.support`).
The result is gathered into the same HF/peft dir a one-process run writes; checkpoints keep the
trained weights' and the optimizer's shards with torch.distributed.checkpoint.
"""

from __future__ import annotations

import contextlib
import logging
import math
from pathlib import Path
from typing import Dict, List, Optional

import torch

from ftctl.errors import ConfigError, FtctlError
from ftctl.parallel.base import (
    Engine,
    StepResult,
    apply_checkpointing,
    clip_local_grads,
    local_grads,
)
from ftctl.parallel.distributed import DataParallelBackend
from ftctl.parallel.mesh_shape import AXES, mesh_shape, microbatches, stages_per_rank
from ftctl.parallel.support import CHECKPOINT_STATE_DIRS

log = logging.getLogger("ftctl")
STATE_DIR = CHECKPOINT_STATE_DIRS["mesh"]


def model_refusal(cfg, model_config) -> Optional[str]:
    """What the model's own config (transformers' PretrainedConfig) rules out for this mesh, before any weight loads."""
    from ftctl.parallel.mesh_shape import check_stage_count, tied_embeddings_refusal

    p = cfg.parallel
    text = model_config.get_text_config() if hasattr(model_config, "get_text_config") else model_config
    if p.tp_size > 1 and not getattr(text, "base_model_tp_plan", None):
        return f"parallel.tp_size={p.tp_size}: {type(model_config).__name__} has no tensor-parallel plan (base_model_tp_plan); use tp_size=1"
    if p.ep_size > 1 and not getattr(text, "base_model_ep_plan", None):
        return (f"parallel.ep_size={p.ep_size}: {type(model_config).__name__} has no expert-parallel plan "
                "(base_model_ep_plan; MoE families such as Mixtral and Qwen3-MoE have one); use ep_size=1")
    return (check_stage_count(cfg, getattr(text, "num_hidden_layers", None))
            or tied_embeddings_refusal(cfg, bool(getattr(text, "tie_word_embeddings", False))))


class MeshBackend(DataParallelBackend):
    def __init__(self, cfg):
        super().__init__(cfg)
        from torch.distributed.device_mesh import init_device_mesh

        try:
            self.shape = mesh_shape(cfg.parallel, self.world_size)
        except ValueError as exc:
            self.close()
            raise ConfigError(f"{exc} (the launcher started {self.world_size} ranks)") from None
        self._check_model()
        s = self.shape
        self.mesh = init_device_mesh(self.device.type, s.sizes(), mesh_dim_names=AXES)
        self.expert_mesh = None
        if s.ep > 1:
            self.expert_mesh = init_device_mesh(self.device.type, (s.pp, s.dp_replicate, s.efsdp, s.ep),
                                                mesh_dim_names=("pp", "dp_replicate", "efsdp", "ep"))
        self.coords = {axis: self.mesh.get_local_rank(axis) for axis in AXES}
        self.stages: Optional[list] = None
        self.ep_plan: Dict[str, str] = {}
        self.fsdp = False
        if self.is_main:
            log.info("mesh: %s on %d ranks", s.describe(), self.world_size)

    def _check_model(self) -> None:
        from transformers import AutoConfig

        from ftctl.models.loading import resolve_model_path

        m = self.cfg.model
        path = resolve_model_path(m.name_or_path, check_hub=False)
        try:
            config = AutoConfig.from_pretrained(path, revision=m.revision, trust_remote_code=m.trust_remote_code)
        except (OSError, ValueError):
            return  # loading the model reports it
        reason = model_refusal(self.cfg, config)
        if reason:
            self.close()
            raise ConfigError(reason)

    # -- where this rank sits

    @property
    def dp_rank(self) -> int:
        return self.coords["dp_replicate"] * self.shape.dp_shard + self.coords["dp_shard"]

    @property
    def dp_size(self) -> int:
        return self.shape.dp

    @property
    def build_device(self):
        # Split on the host, then each rank's shards move to its GPU; QLoRA quantises where it places, on the GPU.
        if self.device.type == "cuda" and self.cfg.method.name != "qlora":
            return torch.device("cpu")
        return self.device

    def all_reduce_sum(self, value):
        """The sum over data-parallel replicas of a value every rank of a replica (its TP and PP ranks) holds alike.

        Reduced over the whole world, so that a flag one rank raises (a stop request) reaches every rank.
        """
        return super().all_reduce_sum(value) / (self.world_size // self.shape.dp)

    # -- the one ordered function

    def parallelize(self, model: torch.nn.Module) -> torch.nn.Module:
        from ftctl.parallel.pipeline import cut_stages
        from ftctl.parallel.tensor_parallel import apply_expert_parallel, apply_tensor_parallel

        s, cfg = self.shape, self.cfg
        if s.pp > 1:
            self.stages = cut_stages(model, self.coords["pp"], s.pp, stages_per_rank(cfg.parallel))
        if s.tp > 1:
            apply_tensor_parallel(model, self.mesh["tp"])
        if s.ep > 1:
            self.ep_plan = apply_expert_parallel(model, self.expert_mesh["ep"], self.mesh["tp"])
        apply_checkpointing(model, cfg)
        if cfg.train.compile:
            from ftctl.models.compile import COMPILE_BACKEND

            for layer in self._held_layers(model):
                layer.compile(dynamic=True, backend=COMPILE_BACKEND)
        for part in self.parts(model):
            if self.device.type != "cpu":
                part.to(self.device)
        if s.dp > 1:
            self._fully_shard(model)
        self._check_sharded(model)
        return model

    def parts(self, model) -> List[torch.nn.Module]:
        """The modules this rank runs: its pipeline stages, or the whole model."""
        return list(self.stages) if self.stages is not None else [model]

    def _held_layers(self, model) -> List[torch.nn.Module]:
        from ftctl.parallel.fsdp import decoder_layers

        return [layer for layer in decoder_layers(model) if not any(p.is_meta for p in layer.parameters())]

    def _fully_shard(self, model) -> None:
        from torch.distributed.fsdp import fully_shard

        from ftctl.parallel.tensor_parallel import expert_modules

        s, p = self.shape, self.cfg.parallel
        dp_mesh = self.mesh["dp_shard"] if s.dp_replicate == 1 else self.mesh["dp_replicate", "dp_shard"]
        for experts in expert_modules(model, self.ep_plan):
            # The ranks holding the same experts shard them; their gradient covers all dp batches.
            expert_mesh = self.expert_mesh["efsdp"] if s.dp_replicate == 1 else self.expert_mesh["dp_replicate", "efsdp"]
            fully_shard(experts, mesh=expert_mesh, reshard_after_forward=True)
            experts.set_gradient_divide_factor(float(s.dp))
            if s.efsdp > 1:  # a divide factor other than the group size needs a plain sum (gloo has no PREMUL_SUM)
                experts.set_force_sum_reduction_for_comms(True)
        for layer in self._held_layers(model):
            fully_shard(layer, mesh=dp_mesh, reshard_after_forward=p.reshard_after_forward)
        for part in self.parts(model):
            # The root unit: embeddings, final norm and head, kept gathered through forward and backward.
            fully_shard(part, mesh=dp_mesh, reshard_after_forward=False)
        self.fsdp = True

    def _check_sharded(self, model) -> None:
        """Never a silent replicated model: each axis above 1 must have split something."""
        s = self.shape
        params = [p for part in self.parts(model) for p in part.parameters()]
        names = {n for p in params for n in (getattr(getattr(p, "device_mesh", None), "mesh_dim_names", None) or ())}
        missing = [axis for axis, size, name in (("tp", s.tp, "tp"), ("ep", s.ep, "ep"), ("dp_shard", s.dp_shard, "dp_shard"))
                   if size > 1 and name not in names]
        if missing:
            raise FtctlError(f"parallel=mesh: no parameter of {type(model).__name__} was split over {', '.join(missing)}")

    def prepare(self, model, make_optimizer, precision):
        if self.stages is None:
            return MeshEngine(model, make_optimizer(model), self, model)
        from ftctl.parallel.pipeline import build_schedule

        container = torch.nn.ModuleList(self.stages)
        engine = PipelineEngine(container, make_optimizer(container), self, model, precision)
        engine.schedule = build_schedule(self.cfg.parallel.pp_schedule, engine.pipeline_stages(), engine.microbatches,
                                         engine.loss_fn)
        return engine


# ------------------------------------------------------------------------------------------ engines


def squared_norm_share(params, shape) -> torch.Tensor:
    """This rank's share of the global squared gradient norm, such that the shares summed over the world and
    divided by the ranks of a data-parallel replica (what :meth:`MeshBackend.all_reduce_sum` does, in the step's
    one reduction) give the global squared norm; float64 on the device, nothing read back.

    A gradient's local part (a DTensor's shard, or a plain tensor) is held alike by every rank that
    differs from this one only along an axis that does not split it: the mesh axes outside its
    DTensor mesh but pp (stages hold different parameters) and its mesh's Replicate dims. Each copy
    counts its share of one.
    """
    from torch.distributed.tensor import DTensor, Partial, Replicate

    replica_ranks = shape.world // shape.dp
    locals_by_copies: Dict[int, list] = {}
    for p in params:
        g = p.grad
        if g is None:
            continue
        if isinstance(g, DTensor):
            if any(isinstance(placement, Partial) for placement in g.placements):
                g = g.redistribute(placements=[Replicate() if isinstance(pl, Partial) else pl for pl in g.placements])
            mesh = g.device_mesh
            replicated = math.prod(mesh.size(i) for i, pl in enumerate(g.placements) if isinstance(pl, Replicate))
            copies = shape.world // (shape.pp * mesh.size()) * replicated
            local = g.to_local()
        else:
            copies, local = shape.world // shape.pp, g
        locals_by_copies.setdefault(copies, []).append(local)
    device = next((t.device for ts in locals_by_copies.values() for t in ts), torch.device("cpu"))
    share = torch.zeros((), dtype=torch.float64, device=device)
    for copies, tensors in locals_by_copies.items():
        squares = torch.stack(torch._foreach_norm(tensors)).double().square().sum()
        share += squares * (replica_ranks / copies)
    return share


class MeshEngine(Engine):
    def __init__(self, module, optimizer, backend: MeshBackend, model):
        self.module, self.optimizer, self.backend, self.model = module, optimizer, backend, model

    def accumulating(self, last_micro_batch):
        if self.backend.fsdp:
            self.module.set_requires_gradient_sync(last_micro_batch)
        return contextlib.nullcontext()

    def backward(self, loss):
        loss.backward()

    def _params(self):
        return [p for group in self.optimizer.param_groups for p in group["params"]]

    def step(self, max_grad_norm, sync):
        share = squared_norm_share(self._params(), self.backend.shape)
        # The step's one reduction adds the shares up (sharded: the root of the summed squares); clipping
        # then scales the local parts on the device, as torch's clip_grad_norm_ would the whole gradients.
        norm, grad_norm = sync(share.sqrt(), sharded=True)
        clip_local_grads(local_grads(self.optimizer), norm, max_grad_norm)
        skipped = not math.isfinite(grad_norm)  # a NaN/inf update would destroy the weights
        if not skipped:
            self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        self.skipped_steps += skipped
        return StepResult(grad_norm, skipped)

    def gathered_state_dict(self):
        """The trained weights (and buffers), unsharded, on rank 0: DTensors gathered, stages collected over the pipeline."""
        import torch.distributed as dist
        from torch.distributed.tensor import DTensor

        # Read off the modules rather than state_dict(): parts another stage holds are meta tensors, which a
        # quantised layer's state_dict hook cannot handle, and what is frozen never needs gathering.
        kept = [(name, p) for name, p in self.model.named_parameters(remove_duplicate=False) if p.requires_grad]
        for module_name, module in self.model.named_modules():
            for name, buffer in module._buffers.items():
                if buffer is not None and name not in module._non_persistent_buffers_set:
                    kept.append((f"{module_name}.{name}" if module_name else name, buffer))
        local = {}
        for name, tensor in kept:
            if tensor.is_meta:
                continue
            full = tensor.full_tensor() if isinstance(tensor, DTensor) else tensor
            local[name] = full.detach().cpu()
        backend = self.backend
        if backend.shape.pp == 1:
            return local if backend.is_main else None
        leader = backend.coords["dp_replicate"] == backend.coords["dp_shard"] == backend.coords["tp"] == 0
        gathered = [None] * backend.world_size if backend.is_main else None
        dist.gather_object(local if leader else {}, gathered, dst=0)
        if not backend.is_main:
            return None
        state = {}
        for part in gathered:
            state.update(part)
        return state

    def _sharded_state(self):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

        model_state, optim_state = get_state_dict(self.module, self.optimizer, options=StateDictOptions(ignore_frozen_params=True))
        # Under one key per pipeline rank: DCP keeps one copy of equal keys, and the optimizer's param groups
        # (the names of the parameters in each) differ from stage to stage.
        return {f"pp{self.backend.coords['pp']}": {"model": model_state, "optimizer": optim_state}}

    def save_training_state(self, ckpt_dir, rank):
        import torch.distributed.checkpoint as dcp

        dcp.save(self._sharded_state(), checkpoint_id=str(Path(ckpt_dir) / STATE_DIR))

    def load_training_state(self, ckpt_dir, rank):
        import torch.distributed.checkpoint as dcp
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict

        state = self._sharded_state()
        dcp.load(state, checkpoint_id=str(Path(ckpt_dir) / STATE_DIR))
        (mine,) = state.values()
        set_state_dict(self.module, self.optimizer, model_state_dict=mine["model"], optim_state_dict=mine["optimizer"],
                       options=StateDictOptions(ignore_frozen_params=True, strict=False))


class PipelineEngine(MeshEngine):
    """A step is one run of torch's pipeline schedule over all of the step's micro-batches."""

    def __init__(self, module, optimizer, backend: MeshBackend, model, precision):
        super().__init__(module, optimizer, backend, model)
        from ftctl.config.validate import gradient_accumulation_steps

        cfg = backend.cfg
        accumulation = gradient_accumulation_steps(cfg, backend.world_size)
        self.precision = precision
        self.microbatches = microbatches(cfg, accumulation)
        self.rows = cfg.train.micro_batch_size * accumulation // self.microbatches
        self.width = cfg.data.max_seq_len
        self.scale = 1.0
        self.schedule = None

    def pipeline_stages(self):
        from torch.distributed.pipelining import PipelineStage

        b = self.backend
        return [PipelineStage(stage, stage.index, b.shape.pp * stages_per_rank(b.cfg.parallel), b.device,
                              group=b.mesh.get_group("pp"))
                for stage in self.module]

    def loss_fn(self, output, target):
        return output * self.scale  # the last stage's output is its micro-batch's summed token loss

    def _run(self, ids, mask, targets, train: bool) -> torch.Tensor:
        """The run's summed token loss on the last stage's ranks, times the stage count, and 0 on the others: the
        step's one reduction (and evaluation's) sums over the world and divides by a replica's pp × tp ranks."""
        b = self.backend
        device = b.device
        ids, mask, targets = ids.to(device), mask.to(device), targets.to(device)
        args = (ids,) if b.coords["pp"] == 0 else ()
        losses: List[torch.Tensor] = []
        self.scale = self.scale if train else 1.0
        with self.precision.autocast():
            run = self.schedule.step if train else self.schedule.eval
            run(*args, target=targets, losses=losses, return_outputs=False, attention_mask=mask, targets=targets)
        total = torch.zeros((), dtype=torch.float64, device=device)
        for loss in losses:  # only the last stage has them
            total += loss.detach().double() * (b.shape.pp / self.scale)
        return total

    def forward_backward(self, batches, loss_of, scale, device):
        from ftctl.parallel.pipeline import pipeline_inputs

        self.scale = scale
        ids, mask, targets = pipeline_inputs(batches, self.backend.cfg.train.micro_batch_size, self.width, self._pad_id(batches))
        return self._run(ids, mask, targets, train=True)

    @torch.no_grad()
    def eval_loss_sum(self, batches, loss_of):
        from ftctl.parallel.pipeline import pipeline_inputs

        micro = self.backend.cfg.train.micro_batch_size
        ids, mask, targets = pipeline_inputs(batches, micro, self.width, self._pad_id(batches))
        per_run = self.microbatches * self.rows
        missing = -len(ids) % per_run
        if missing:  # rows that train nothing, to fill the schedule's micro-batches
            from ftctl.data.render import IGNORE_INDEX

            ids = torch.cat([ids, ids.new_zeros((missing, self.width))])
            filler = mask.new_zeros((missing, self.width))
            filler[:, 0] = 1
            mask = torch.cat([mask, filler])
            targets = torch.cat([targets, targets.new_full((missing, self.width), IGNORE_INDEX)])
        total = None
        for start in range(0, len(ids), per_run):
            part = slice(start, start + per_run)
            loss = self._run(ids[part], mask[part], targets[part], train=False)
            total = loss if total is None else total + loss
        return total

    @staticmethod
    def _pad_id(batches) -> int:
        # Padded positions are masked from attention and loss, so any token id serves; the batch's own padding is reused.
        batch = batches[0]
        pad = batch.input_ids[batch.attention_mask == 0]
        return int(pad[0]) if pad.numel() else 0
