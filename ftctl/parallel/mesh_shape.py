"""The device mesh of ``parallel=mesh`` as arithmetic: its axes, their sizes, the pipeline's stages. No torch.

One mesh covers the world: ``pp × dp_replicate × dp_shard × tp`` ranks (torchtitan's order: the
pipeline axis outermost, tensor parallel innermost so its ranks are neighbours, on one node).
Expert parallelism adds no ranks: its ``ep`` ranks are carved out of ``dp_shard × tp`` (as in
torchtitan and transformers), so ``ep`` is a multiple of ``tp`` that divides ``dp_shard × tp``, and
the ranks holding the same experts, ``efsdp = dp_shard × tp / ep``, shard them with FSDP2.

Read by config validation, the memory estimate and the dry run before anything loads, and by the
mesh backend to build the torch ``DeviceMesh``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional, Tuple

PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b")
#: Axis order of the dense mesh, outermost first.
AXES = ("pp", "dp_replicate", "dp_shard", "tp")


@dataclass(frozen=True)
class MeshShape:
    pp: int = 1
    dp_replicate: int = 1
    dp_shard: int = 1
    tp: int = 1
    ep: int = 1

    @property
    def world(self) -> int:
        return self.pp * self.dp_replicate * self.dp_shard * self.tp

    @property
    def dp(self) -> int:
        """Ranks that each see their own share of the global batch."""
        return self.dp_replicate * self.dp_shard

    @property
    def efsdp(self) -> int:
        """Ranks holding the same experts (FSDP-sharded among them)."""
        return self.dp_shard * self.tp // self.ep

    def sizes(self) -> Tuple[int, ...]:
        return tuple(getattr(self, axis) for axis in AXES)

    def describe(self) -> str:
        """'pp 2 × dp_shard 4 × tp 8 (ep 2)', axes of size 1 left out."""
        parts = [f"{axis} {getattr(self, axis)}" for axis in AXES if getattr(self, axis) > 1] or ["1 rank"]
        return " × ".join(parts) + (f" (ep {self.ep} over dp_shard × tp)" if self.ep > 1 else "")

    def coordinates(self, rank: int) -> dict:
        """This global rank's index on each axis (row-major over AXES, as init_device_mesh lays ranks out)."""
        coords, rest = {}, rank
        for axis in reversed(AXES):
            size = getattr(self, axis)
            coords[axis] = rest % size
            rest //= size
        return coords


def mesh_shape(p, world: int) -> MeshShape:
    """The mesh a parallel config gives on ``world`` ranks; raises ValueError with a one-line reason."""
    for key in ("tp_size", "pp_size", "ep_size", "dp_replicate_size"):
        if getattr(p, key) < 1:
            raise ValueError(f"parallel.{key}={getattr(p, key)} must be >= 1")
    if p.dp_shard_size == 0 or p.dp_shard_size < -1:
        raise ValueError(f"parallel.dp_shard_size={p.dp_shard_size} must be >= 1, or -1 for the rest of the world size")
    fixed = p.pp_size * p.dp_replicate_size * p.tp_size
    if p.dp_shard_size == -1:
        if world % fixed:
            raise ValueError(
                f"the mesh pp {p.pp_size} × dp_replicate {p.dp_replicate_size} × tp {p.tp_size} = {fixed} does not divide "
                f"the world size {world} (nnodes × nproc_per_node); change the sizes or the number of processes"
            )
        dp_shard = world // fixed
    else:
        dp_shard = p.dp_shard_size
        if fixed * dp_shard != world:
            raise ValueError(
                f"the mesh pp {p.pp_size} × dp_replicate {p.dp_replicate_size} × dp_shard {dp_shard} × tp {p.tp_size} = "
                f"{fixed * dp_shard} ranks, but the world size (nnodes × nproc_per_node) is {world}; set "
                f"parallel.dp_shard_size=-1 to take the rest of the world"
            )
    shape = MeshShape(p.pp_size, p.dp_replicate_size, dp_shard, p.tp_size, p.ep_size)
    if shape.ep > 1 and (shape.ep % shape.tp or (shape.dp_shard * shape.tp) % shape.ep):
        raise ValueError(
            f"parallel.ep_size={shape.ep}: expert-parallel ranks come out of dp_shard × tp = {shape.dp_shard} × {shape.tp}, "
            f"so ep_size must be a multiple of tp_size={shape.tp} that divides {shape.dp_shard * shape.tp}"
        )
    return shape


def data_parallel_size(cfg, world: int) -> int:
    """Ranks with their own share of each global batch: the world for data-parallel backends, dp of a mesh."""
    if cfg.parallel.name != "mesh":
        return world
    try:
        return mesh_shape(cfg.parallel, world).dp
    except ValueError:
        return world  # the mesh's own check reports it


# ------------------------------------------------------------------------------------- the pipeline


def stages_per_rank(p) -> int:
    return p.pp_stages_per_rank if p.pp_schedule == "interleaved_1f1b" else 1


def stage_layer_ranges(num_layers: int, stages: int) -> List[range]:
    """Consecutive decoder layers of each stage, the remainder one each to the first stages (as transformers splits)."""
    per, extra = divmod(num_layers, stages)
    out, start = [], 0
    for s in range(stages):
        end = start + per + (s < extra)
        out.append(range(start, end))
        start = end
    return out


def rank_stages(pp_rank: int, pp: int, per_rank: int) -> List[int]:
    """The stage indices pipeline rank ``pp_rank`` runs: one, or ``per_rank`` looped ones for interleaved 1F1B."""
    return [pp_rank + k * pp for k in range(per_rank)]


def microbatches(cfg, accumulation: int) -> int:
    return cfg.parallel.pp_microbatches or accumulation


def bubble_ratio(pp: int, microbatches_: int, per_rank: int = 1) -> float:
    """Idle share of a pipeline step: (p − 1) / (m + p − 1); interleaving v stages a rank shrinks it to (p − 1) / (v·m + p − 1)."""
    if pp <= 1:
        return 0.0
    return (pp - 1) / (per_rank * microbatches_ + pp - 1)


def in_flight_microbatches(schedule: str, pp: int, microbatches_: int, per_rank: int, pp_rank: int = 0) -> float:
    """Micro-batches whose activations rank ``pp_rank`` holds at its peak, in units of one full stage's layers.

    GPipe runs every forward before any backward (all m); 1F1B starts backwards after p − rank
    forwards; interleaved 1F1B warms up (v − 1)·(m / rounds) + 2·(p − 1 − rank) chunks of 1/v of a
    rank's layers (torch's schedule), plus the one in flight.
    """
    if pp <= 1:
        return 1.0
    if schedule == "gpipe":
        return float(microbatches_)
    if schedule == "1f1b":
        return float(min(microbatches_, pp - pp_rank))
    rounds = max(1, microbatches_ // pp)
    warmup = min((per_rank - 1) * (microbatches_ // rounds) + 2 * (pp - 1 - pp_rank), microbatches_ * per_rank)
    return (warmup + 1) / per_rank


def stage_summary(num_layers: int, pp: int, per_rank: int) -> List[Tuple[int, List[range]]]:
    """(pipeline rank, the layer ranges of its stages) for every pipeline rank."""
    ranges = stage_layer_ranges(num_layers, pp * per_rank)
    return [(r, [ranges[s] for s in rank_stages(r, pp, per_rank)]) for r in range(pp)]


def describe_stages(num_layers: int, pp: int, per_rank: int) -> List[str]:
    lines = []
    last = pp * per_rank - 1
    for r, ranges in stage_summary(num_layers, pp, per_rank):
        parts = []
        for k, layers in enumerate(ranges):
            stage = r + k * pp
            extra = (["embeddings"] if stage == 0 else []) + (["final norm", "head"] if stage == last else [])
            span = f"layers {layers.start}-{layers.stop - 1}" if len(layers) > 1 else f"layer {layers.start}"
            parts.append(f"stage {stage}: {span}" + (f" + {', '.join(extra)}" if extra else ""))
        lines.append(f"pp rank {r}: " + "; ".join(parts))
    return lines


def check_stage_count(cfg, num_layers: Optional[int]) -> Optional[str]:
    """A reason the pipeline cannot be cut from ``num_layers`` decoder layers, or None."""
    p = cfg.parallel
    if p.name != "mesh" or p.pp_size <= 1 or num_layers is None:
        return None
    stages = p.pp_size * stages_per_rank(p)
    if stages > num_layers:
        what = (f"parallel.pp_size={p.pp_size} × parallel.pp_stages_per_rank={p.pp_stages_per_rank}" if stages_per_rank(p) > 1
                else f"parallel.pp_size={p.pp_size}")
        return f"{what} cuts {stages} pipeline stages, but the model has {num_layers} decoder layers; use at most {num_layers} stages"
    return None


def tied_embeddings_refusal(cfg, tied: bool) -> Optional[str]:
    if cfg.parallel.name == "mesh" and cfg.parallel.pp_size > 1 and tied:
        return ("parallel.pp_size>1 with tied input and output embeddings (tie_word_embeddings): the first and the last "
                "stage would each train their own copy; use pp_size=1 (tp, fsdp) for this model")
    return None
