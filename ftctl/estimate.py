"""Per-rank memory of a training run, worked out from the model's config.json and the run config alone.

Pure arithmetic (no torch, no weights), so ``ftctl estimate`` and ``ftctl train --dry-run`` answer
in well under a second, for a 7B model as for a tiny one. The parts:

* weights: every parameter in the dtype ftctl keeps it in. Trained weights are fp32 master
  copies; a frozen base of LoRA/DoRA sits in the compute dtype; QLoRA's base linear layers hold
  4-bit codes (half a byte per parameter) plus one quantisation constant per block of 64 (fp32,
  or 8-bit with a small fp32 second level under double quantisation), the rest (embeddings,
  norms, head) sits in the compute dtype like a LoRA base.
* gradients: fp32, one per trained parameter. DDP adds its bucket copy of them.
* optimizer states: AdamW's two fp32 moments per trained parameter (8-bit AdamW: two bytes;
  the other optimizers: :func:`optimizer_state_bytes`); DeepSpeed also keeps an fp32 master copy
  of the partition it optimises (12 bytes in all with AdamW).
* activations: the tensors autograd keeps from forward to backward for one micro-batch of
  ``micro_batch_size × data.max_seq_len`` tokens, counted tensor by tensor for a pre-norm Llama
  layer with sdpa attention and peft's LoRA layers (see :func:`layer_activation_elements`), plus
  the loss and a backward working set. With gradient checkpointing only each checkpointed layer's
  input stays (every layer, or every k-th with ``train.gradient_checkpointing_every``; the others
  keep all of theirs), and one layer is recomputed at a time.
* sharding over N ranks divides exactly what the backend shards: ZeRO-1 the optimizer states,
  ZeRO-2 also the gradients, ZeRO-3 and FSDP also the weights (ZeRO-3 keeps parameters smaller
  than ``parallel.zero3_persistence_threshold`` whole). Sharded weights are gathered one layer at a
  time for compute ("gathered"). Offloaded parts move to CPU memory and leave the device total.

The total is the sum of the parts, which is what a step reaches when gradients from earlier
micro-batches are held while the next micro-batch's activations build up (any run with gradient
accumulation); it is an upper bound by up to the smaller of gradients and activations otherwise.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Dict, List, Tuple

from ftctl.config.schema import RunConfig
from ftctl.errors import ConfigError
from ftctl.models.architecture import HEAD_RETURNS_PLAIN_LOGITS, LINEAR_NAMES, Architecture
from ftctl.parallel.support import bucket_elements
from ftctl.paths import model_configs_dir
from ftctl.precision.auto import auto_precision
from ftctl.preflight import gpu_visible, visible_device_type

DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2}
QUANT_BLOCK = 64  # bitsandbytes 4-bit block size
DOUBLE_QUANT_BLOCK = 256  # blocks per second-level constant
ADAM_8BIT_BLOCK = 256  # bitsandbytes 0.4x-0.50 8-bit optimizer states: one fp32 absmax per 256 values
#: Logit elements the chunked loss holds at once (ftctl.training.loss.CHUNK_ELEMENTS).
LOSS_CHUNK_ELEMENTS = 1 << 23
SHARDS = {  # which parts each backend divides by the world size
    "single": (), "ddp": (),
    "zero1": ("optimizer",), "zero2": ("optimizer", "gradients"), "zero3": ("optimizer", "gradients", "weights"),
    "fsdp": ("optimizer", "gradients", "weights"),
}


# ------------------------------------------------------------------------------------ model config


def load_model_config(cfg: RunConfig) -> Tuple[dict, str]:
    """The architecture dict and where it came from, without loading (or building) any weights.

    model.config_file (in recipes/model_configs, or a path) wins; then the config.json of a local
    model dir or of an already-built alias; then the shipped model_configs/<alias>.json of an alias.
    """
    m = cfg.model
    candidates: List[Path] = []
    if m.config_file:
        given = Path(m.config_file).expanduser()
        candidates += [given, model_configs_dir() / m.config_file]
        found = next((p for p in candidates if p.is_file()), None)
        if found is None:
            raise ConfigError(f"model.config_file={m.config_file}: no such file here or in {model_configs_dir()}")
        return _read_json(found), str(found)
    from ftctl.models.aliases import alias_dir, is_alias  # no torch

    if is_alias(m.name_or_path):
        candidates += [alias_dir(m.name_or_path) / "config.json", model_configs_dir() / f"{m.name_or_path}.json"]
    else:
        candidates.append(Path(m.name_or_path).expanduser() / "config.json")
    found = next((p for p in candidates if p.is_file()), None)
    if found is None:
        raise ConfigError(
            f"no architecture known for model.name_or_path={m.name_or_path} without downloading it; set "
            "model.config_file to its config.json (a path, or a file in recipes/model_configs)"
        )
    return _read_json(found), str(found)


def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        raise ConfigError(f"{path}: not valid JSON ({exc})") from None


def machine_precision(name: str) -> str:
    """What precision=auto resolves to on this machine, by the rule training uses, without torch
    (fp16 on old GPUs has bf16's size)."""
    return auto_precision(visible_device_type()) if name == "auto" else name


# ------------------------------------------------------------------------------------- the estimate


@dataclass
class MemoryEstimate:
    model: str
    method: str
    parallel: str
    world_size: int
    precision: str
    micro_batch_size: int
    seq_len: int
    gradient_checkpointing: bool
    parameters: int
    trainable_parameters: int
    weights_bytes: int
    gradients_bytes: int
    optimizer_bytes: int
    activations_bytes: int  # as configured (with or without checkpointing)
    activations_without_checkpointing_bytes: int
    activations_with_checkpointing_bytes: int
    gathered_bytes: int  # sharded weights gathered for compute: a layer and the prefetched next (FSDP: plus its root)
    buffers_bytes: int  # DeepSpeed's gradient reduction buckets
    offloaded_bytes: int  # moved to CPU memory; not in the device total
    total_bytes: int
    notes: List[str] = field(default_factory=list)
    # parallel=mesh: the mesh, each pipeline rank's layers and total, and the pipeline's idle share.
    mesh: str = ""
    stages: List[str] = field(default_factory=list)
    stage_totals_bytes: List[int] = field(default_factory=list)
    bubble_ratio: float = 0.0

    def to_dict(self) -> dict:
        return asdict(self)


def estimate_memory(cfg: RunConfig, model_config: dict, source: str = "config") -> MemoryEstimate:
    arch = Architecture.from_config(model_config, source)
    if cfg.parallel.name == "mesh":
        return estimate_mesh_memory(cfg, arch, source)
    m, p, t = cfg.method, cfg.parallel, cfg.train
    world = p.nproc_per_node * p.nnodes
    precision = machine_precision(cfg.precision.name)
    notes: List[str] = []
    if cfg.precision.name == "auto":
        notes.append(f"precision=auto is {precision} on this machine; set precision=bf16 to plan for a GPU")
    deepspeed = p.name.startswith("zero")
    ds_fp16 = deepspeed and precision == "fp16"

    adapted, unknown = _adapted_linears(m.target_modules) if m.name != "full" else (set(), [])
    if unknown:
        notes.append(f"target modules not counted (not a decoder linear layer): {', '.join(unknown)}")
    if arch.experts:
        adapted &= set(arch.linear_shapes())
        notes.append(
            f"mixture of experts: {arch.experts} experts per MoE layer, {arch.experts_per_token} active per token; "
            "the experts are fused parameters, not linear layers, so target_modules adapt none of them"
        )
    params = _parameter_groups(arch, cfg, adapted)
    trainable = params["trainable"]

    # Weights, in the dtype each group is stored in (bytes per parameter).
    compute = DTYPE_BYTES[precision]
    if m.name == "full":
        weight_bytes = {"trainable": 2 if ds_fp16 else 4}
    elif m.name == "qlora":
        constants = (1 / QUANT_BLOCK + 4 / (QUANT_BLOCK * DOUBLE_QUANT_BLOCK)) if m.double_quant else 4 / QUANT_BLOCK
        # What is not quantised (embeddings, norms, head) stays in the compute dtype (ftctl.methods.quantization).
        weight_bytes = {"quantized": 0.5 + constants, "frozen": compute, "trainable": 4}
    else:
        weight_bytes = {"frozen": compute, "trainable": 4}
    weights_by_group = {g: params[g] * b for g, b in weight_bytes.items()}

    gradients = trainable * (2 if ds_fp16 else 4) * (2 if p.name == "ddp" else 1)
    if p.name == "ddp":
        notes.append("ddp: gradients counted twice (DDP's communication buckets hold a copy)")
    optimizer_per_param = optimizer_state_bytes(t, m, arch)
    if t.optimizer == "adafactor":
        notes.append("adafactor: factored second moments counted as one fp32 row and column per matrix")
    optimizer = trainable * (optimizer_per_param + (4 if deepspeed else 0))

    # Sharding.
    shards = SHARDS[p.name]
    weights = sum(weights_by_group.values())
    gathered = 0.0
    if "weights" in shards:
        keep_whole = _small_parameter_bytes(arch, cfg, weight_bytes, adapted) if p.name == "zero3" else 0.0
        layer_bytes = weights_by_group_per_layer(arch, params, weight_bytes)
        weights = keep_whole + (weights - keep_whole) / world
        # One layer gathered while the next is prefetched; FSDP also keeps its root unit
        # (embeddings, final norm, head) gathered through forward and backward, and without
        # reshard_after_forward every layer stays gathered from its forward until its backward.
        held = arch.layers if p.name == "fsdp" and not p.reshard_after_forward else 2
        gathered = held * layer_bytes * (world - 1) / world
        if p.name == "fsdp":
            root = (arch.embedding_parameters() + arch.head_parameters() + arch.hidden) * _root_bytes(m.name, weight_bytes)
            gathered += root * (world - 1) / world
    if "gradients" in shards:
        gradients /= world
    if "optimizer" in shards:
        optimizer /= world

    # Activations.
    tokens = t.micro_batch_size * cfg.data.max_seq_len
    # Matmul outputs come in the compute dtype. The residual stream has the weights' dtype: fp32 for
    # full fine-tuning (master weights), compute for the frozen bases of LoRA, DoRA and QLoRA.
    matmul_dtype = compute
    stream_dtype = 4 if m.name == "full" else compute
    full_act, ckpt_act, act_notes = activation_bytes(arch, cfg, adapted, tokens, stream_dtype, matmul_dtype,
                                                     every=t.gradient_checkpointing_every)
    if m.name == "full" and compute < 4 and not deepspeed:
        # Under autocast every fp32 master weight of a linear layer is cast to the compute dtype for
        # its matmul, and backward keeps that copy for the input's gradient: one copy of all decoder
        # linear weights from forward to backward (with checkpointing, those of the layers left out and
        # of the one recomputed in turn).
        layer_linear = sum(i * o for i, o, _ in arch.linear_shapes().values())
        left_out = arch.layers - math.ceil(arch.layers / t.gradient_checkpointing_every)
        full_act += arch.layers * layer_linear * compute
        ckpt_act += (left_out + 1) * layer_linear * compute
    notes += act_notes
    if t.gradient_checkpointing_every > 1:
        notes.append(f"gradient checkpointing of one decoder layer in {t.gradient_checkpointing_every} "
                     f"({math.ceil(arch.layers / t.gradient_checkpointing_every)} of {arch.layers})")
    activations = ckpt_act if t.gradient_checkpointing else full_act

    # DeepSpeed reduces gradients through fp32 buckets of ftctl's reduce_bucket_size; ZeRO-2 on GPUs
    # overlaps reduction with backward (overlap_comm) and holds two.
    buffers = 0.0
    if deepspeed:
        buffers = bucket_elements(arch.hidden) * 4 * (2 if p.name == "zero2" else 1)
    offloaded = 0.0
    if p.offload_optimizer == "cpu" and deepspeed:
        # The fp32 gradient partition lives with the optimizer it feeds, on the CPU.
        offloaded += optimizer + (gradients if p.name in ("zero2", "zero3") else 0.0)
        optimizer = 0.0
        if p.name in ("zero2", "zero3"):
            gradients = 0.0
    if p.offload_params == "cpu" and p.name in ("zero3", "fsdp"):
        offloaded += weights
        weights = 0.0
        if p.name == "fsdp":  # FSDP's CPU offload keeps gradients and the optimizer step on the CPU as well
            offloaded += gradients + optimizer
            gradients = optimizer = 0.0

    total = weights + gradients + optimizer + activations + gathered + buffers
    return MemoryEstimate(
        model=source, method=m.name, parallel=p.name, world_size=world, precision=precision,
        micro_batch_size=t.micro_batch_size, seq_len=cfg.data.max_seq_len,
        gradient_checkpointing=t.gradient_checkpointing, parameters=params["total"], trainable_parameters=trainable,
        weights_bytes=round(weights), gradients_bytes=round(gradients), optimizer_bytes=round(optimizer),
        activations_bytes=round(activations), activations_without_checkpointing_bytes=round(full_act),
        activations_with_checkpointing_bytes=round(ckpt_act), gathered_bytes=round(gathered), buffers_bytes=round(buffers),
        offloaded_bytes=round(offloaded), total_bytes=round(total), notes=notes,
    )


def _adapted_linears(targets) -> Tuple[set, List[str]]:
    """Which decoder linear layers peft adapts for these target_modules (suffix match, like peft)."""
    targets = list(targets)
    if targets == ["all-linear"]:
        return set(LINEAR_NAMES), []
    adapted = {name for name in LINEAR_NAMES if any(name == t or name.endswith(t) for t in targets)}
    unknown = [t for t in targets if not any(name == t or name.endswith(t) for name in LINEAR_NAMES)]
    return adapted, unknown


def _adapter_parameters(arch: Architecture, cfg: RunConfig, adapted: set) -> int:
    shapes = arch.linear_shapes()
    per_layer = sum(cfg.method.r * (shapes[n][0] + shapes[n][1]) for n in adapted)
    if cfg.method.use_dora or cfg.method.name == "dora":
        per_layer += sum(shapes[n][1] for n in adapted)  # DoRA's magnitude vector
    return per_layer * arch.layers


def _parameter_groups(arch: Architecture, cfg: RunConfig, adapted: set) -> Dict[str, int]:
    """Parameter counts: total, trainable, and the frozen base split into quantised / other where it applies."""
    total = arch.parameters()
    if cfg.method.name == "full":
        return {"total": total, "trainable": total}
    adapter = _adapter_parameters(arch, cfg, adapted)
    saved = 0
    for name in cfg.method.modules_to_save:
        # peft trains a copy of each such module and keeps the original frozen.
        if name.endswith("lm_head"):
            saved += arch.vocab * arch.hidden
        elif name.endswith("embed_tokens"):
            saved += arch.vocab * arch.hidden
    linear_weights = arch.layers * sum(i * o for i, o, _ in arch.linear_shapes().values())
    groups = {"total": total + adapter + saved, "trainable": adapter + saved}
    if cfg.method.name == "qlora":
        groups.update(quantized=linear_weights, frozen=total - linear_weights)
    else:
        groups.update(frozen=total)
    return groups


def weights_by_group_per_layer(arch: Architecture, params: Dict[str, int], weight_bytes: Dict[str, float]) -> float:
    """Bytes of one decoder layer's weights (what a sharded backend gathers at a time)."""
    layer = arch.layer_parameters()
    if "quantized" in weight_bytes:
        linear = sum(i * o for i, o, _ in arch.linear_shapes().values())
        own = linear * weight_bytes["quantized"] + (layer - linear) * weight_bytes["frozen"]
    else:
        own = layer * weight_bytes.get("frozen", weight_bytes["trainable"])
    adapter = params["trainable"] / arch.layers if "frozen" in weight_bytes else 0
    return own + adapter * weight_bytes["trainable"]


def _root_bytes(method: str, weight_bytes: Dict[str, float]) -> float:
    return weight_bytes["trainable"] if method == "full" else weight_bytes["frozen"]


def _small_parameter_bytes(arch: Architecture, cfg: RunConfig, weight_bytes, adapted: set) -> float:
    """Bytes of the parameters ZeRO-3 keeps whole: those below parallel.zero3_persistence_threshold elements."""
    threshold = getattr(cfg.parallel, "zero3_persistence_threshold", 0)
    if threshold <= 0:
        return 0.0
    base_bytes = weight_bytes.get("frozen", weight_bytes["trainable"])
    sizes: List[Tuple[int, float]] = [(arch.hidden, base_bytes)] * (2 * arch.layers + 1)  # norms
    for i, o, bias in arch.linear_shapes().values():
        per = weight_bytes["quantized"] if "quantized" in weight_bytes else base_bytes
        sizes += [(i * o, per)] * arch.layers
        if bias:
            sizes += [(o, base_bytes)] * arch.layers
    sizes += [(arch.vocab * arch.hidden, base_bytes)] * (1 if arch.tied_embeddings else 2)
    if cfg.method.name != "full":
        shapes = arch.linear_shapes()
        for name in adapted:
            i, o, _ = shapes[name]
            sizes += [(cfg.method.r * i, 4.0), (cfg.method.r * o, 4.0)] * arch.layers
    return float(sum(n * b for n, b in sizes if n < threshold))


# ------------------------------------------------------------------------------------- device meshes

#: Linear layers the model's tensor-parallel plan splits row-wise (by input); the others split by output.
ROW_SPLIT = ("o_proj", "down_proj")


def estimate_mesh_memory(cfg: RunConfig, arch: Architecture, source: str) -> MemoryEstimate:
    """Per-rank memory of a ``parallel=mesh`` run: the largest of its pipeline ranks, each worked out part by part.

    A rank holds its stages' layers (plus the embeddings on the first stage, the final norm and head
    on the last), every linear weight and the embeddings and head split 1/tp by the model's plan
    (norms whole), experts split over dp_shard × tp (ep ranks, FSDP over the rest), and LoRA's
    factors as peft splits them (lora_B of a column split, lora_A of a row split). FSDP2 then divides
    weights, gradients and optimizer state by dp_shard (HSDP replicas hold copies). Activations are a
    layer's per micro-batch (TP splits the matmul outputs, not the residual stream) times the stage's
    layers times the micro-batches the schedule keeps in flight; a head split by TP materialises the
    full logits.
    """
    from ftctl.config.validate import gradient_accumulation_steps
    from ftctl.parallel.mesh_shape import (
        bubble_ratio, describe_stages, in_flight_microbatches, mesh_shape, microbatches, rank_stages, stage_summary,
        stages_per_rank,
    )

    m, p, t = cfg.method, cfg.parallel, cfg.train
    world = p.nproc_per_node * p.nnodes
    try:
        shape = mesh_shape(p, world)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    precision = machine_precision(cfg.precision.name)
    notes: List[str] = []
    if cfg.precision.name == "auto":
        notes.append(f"precision=auto is {precision} on this machine; set precision=bf16 to plan for a GPU")
    adapted, unknown = _adapted_linears(m.target_modules) if m.name != "full" else (set(), [])
    if unknown:
        notes.append(f"target modules not counted (not a decoder linear layer): {', '.join(unknown)}")
    if arch.experts:
        adapted &= set(arch.linear_shapes())
    params = _parameter_groups(arch, cfg, adapted)
    compute = DTYPE_BYTES[precision]
    full = m.name == "full"
    dora = not full and (m.use_dora or m.name == "dora")
    base_bytes = 4 if full else compute  # trained master weights, or the frozen base
    linear_bytes = (0.5 + (1 / QUANT_BLOCK + 4 / (QUANT_BLOCK * DOUBLE_QUANT_BLOCK) if m.double_quant else 4 / QUANT_BLOCK)
                    if m.name == "qlora" else base_bytes)
    tp, dp_shard = shape.tp, shape.dp_shard
    expert_split = shape.dp_shard * shape.tp if arch.experts else 1  # ep ranks, then FSDP over the ranks sharing experts

    # One decoder layer on one rank: (weight bytes, trained parameters), before FSDP.
    shapes = arch.linear_shapes()
    linear = sum(i * o + (o if bias else 0) for i, o, bias in shapes.values())
    experts = arch.expert_parameters_per_layer()
    layer_weights = linear / tp * linear_bytes + 2 * arch.hidden * base_bytes
    layer_trained = (linear / tp + 2 * arch.hidden) if full else 0.0
    # A layer's experts on one rank: under ep already over dp_shard × tp (FSDP over efsdp included), so FSDP's
    # division by dp_shard below leaves them out; without ep they split by TP and shard as the rest of the layer.
    layer_experts = experts / (expert_split if shape.ep > 1 else tp)
    expert_fsdp = 1 if shape.ep > 1 else dp_shard
    if not full:
        for name in adapted:
            i, o, _ = shapes[name]
            a, b = m.r * i, o * m.r
            own = (a / tp + b + (o if dora else 0)) if name in ROW_SPLIT else (a + b / tp + (o / tp if dora else 0))
            layer_trained += own
        layer_weights += layer_trained * 4
    embed = arch.embedding_parameters() / tp
    head = arch.head_parameters() / tp + arch.hidden

    per_rank = stages_per_rank(p)
    m_batches = microbatches(cfg, gradient_accumulation_steps(cfg, world))
    tokens = t.micro_batch_size * cfg.data.max_seq_len
    stream_dtype = 4 if full else compute
    stream, matmul, masks = layer_activation_elements(arch, m.name, adapted, m.dropout, m.r, dora, grad_reaches_input=True)
    layer_act = tokens * (stream_dtype * stream + (compute * matmul + masks) / tp)
    if full and compute < 4:
        layer_act += linear / tp * compute  # autocast's copies of the master weights, kept for backward
    optimizer_per_param = {"adamw": 8, "paged_adamw_32bit": 8}.get(t.optimizer, 2 + 8 / ADAM_8BIT_BLOCK)
    summary = stage_summary(arch.layers, shape.pp, per_rank)
    last_stage = shape.pp * per_rank - 1
    totals, parts_by_rank = [], []
    for pp_rank, ranges in summary:
        stages = rank_stages(pp_rank, shape.pp, per_rank)
        n_layers = sum(len(r) for r in ranges)
        first, last = 0 in stages, last_stage in stages
        weights = n_layers * layer_weights + (embed * base_bytes if first else 0) + (head * base_bytes if last else 0)
        trained = n_layers * layer_trained + ((embed if first else 0) + (head if last else 0)) * full
        gradients, optimizer = trained * 4, trained * optimizer_per_param
        gathered = 0.0
        held = n_layers if not p.reshard_after_forward else min(2, n_layers)
        if dp_shard > 1:
            weights, gradients, optimizer = weights / dp_shard, gradients / dp_shard, optimizer / dp_shard
            root = ((embed if first else 0) + (head if last else 0)) * base_bytes
            gathered = (held * layer_weights + root) * (dp_shard - 1) / dp_shard
        expert_weights, expert_trained = n_layers * layer_experts * base_bytes, n_layers * layer_experts * full
        weights += expert_weights / expert_fsdp
        gradients += expert_trained * 4 / expert_fsdp
        optimizer += expert_trained * optimizer_per_param / expert_fsdp
        # FSDP gathers a held layer's experts over the ranks that share them (efsdp under ep, else dp_shard)
        sharing = shape.efsdp if shape.ep > 1 else dp_shard
        gathered += held * layer_experts * base_bytes * (sharing - 1) / expert_fsdp
        in_flight = in_flight_microbatches(p.pp_schedule, shape.pp, m_batches, per_rank, pp_rank)
        if t.gradient_checkpointing:
            act = in_flight * n_layers * tokens * arch.hidden * stream_dtype + layer_act
        else:
            act = in_flight * n_layers * layer_act
        if last:
            if tp > 1:  # the head is split over the vocabulary: full logits are gathered, and their gradient
                act += 2 * tokens * arch.vocab * 4
            else:
                act += tokens * arch.hidden * 4 + min(tokens, max(1, LOSS_CHUNK_ELEMENTS // arch.vocab)) * arch.vocab * 4
            act += tokens * (arch.hidden + 1) * stream_dtype
        act += tokens * (2 * arch.hidden * stream_dtype + 2 * arch.intermediate / tp * compute)  # backward working set
        total = weights + gradients + optimizer + act + gathered
        totals.append(total)
        parts_by_rank.append((weights, gradients, optimizer, act, gathered, in_flight))
    worst = max(range(len(totals)), key=lambda r: totals[r])
    weights, gradients, optimizer, act, gathered, in_flight = parts_by_rank[worst]
    if shape.pp > 1:
        notes.append(f"pipeline rank {worst} shown (the largest); {p.pp_schedule} keeps {in_flight:g} micro-batches' "
                     f"activations of its stage in flight; micro-batches are padded to max_seq_len")
    if tp > 1:
        notes.append(f"tensor parallel: linear weights, embeddings and head 1/{tp}, norms whole; activations' matmul "
                     "outputs 1/tp, the residual stream whole")
    if shape.ep > 1:
        notes.append(f"experts: {arch.experts} per MoE layer over ep {shape.ep} ranks, FSDP over efsdp {shape.efsdp}")
    ratio = bubble_ratio(shape.pp, m_batches, per_rank)
    return MemoryEstimate(
        model=source, method=m.name, parallel=f"mesh ({shape.describe()})", world_size=world, precision=precision,
        micro_batch_size=t.micro_batch_size, seq_len=cfg.data.max_seq_len,
        gradient_checkpointing=t.gradient_checkpointing, parameters=params["total"], trainable_parameters=params["trainable"],
        weights_bytes=round(weights), gradients_bytes=round(gradients), optimizer_bytes=round(optimizer),
        activations_bytes=round(act), activations_without_checkpointing_bytes=round(act),
        activations_with_checkpointing_bytes=round(act), gathered_bytes=round(gathered), buffers_bytes=0, offloaded_bytes=0,
        total_bytes=round(weights + gradients + optimizer + act + gathered), notes=notes, mesh=shape.describe(),
        stages=describe_stages(arch.layers, shape.pp, per_rank) if shape.pp > 1 else [],
        stage_totals_bytes=[round(x) for x in totals], bubble_ratio=ratio,
    )


# ------------------------------------------------------------------------------------- activations


def layer_activation_elements(arch: Architecture, method: str, adapted: set, dropout: float, r: int,
                              dora: bool, grad_reaches_input: bool, dropout_bits: bool = False) -> Tuple[float, float, float]:
    """What one decoder layer keeps for backward per token: (stream elements, matmul-output elements, mask bytes).

    Counted from what each op saves, as autograd does it (tests/test_estimate.py checks it against
    saved-tensor hooks): each RMSNorm keeps its normalised value and 1/rms
    (ftctl.models.fast_rms_norm); a linear layer keeps its input only when its weight trains (one
    copy for layers reading the same tensor); a LoRA layer keeps its input for lora_A and lora_A's
    r outputs. With dropout, ftctl's fused CPU path (``dropout_bits``: plain LoRA in fp32 on a CPU,
    ftctl.methods.fused_lora) keeps the shared input plus 2 bytes of random numbers per element and
    adapter; elsewhere each adapter keeps its own dropped copy and a 1-byte keep mask. sdpa keeps q,
    k, v, its output and the log-sum-exp, and o_proj's input is a contiguous copy of that output;
    the MLP keeps gate, SiLU(gate) and up.
    Returned apart because matmul outputs come in the compute dtype, the rest in the stream's.
    """
    h, a, kv, i, heads = arch.hidden, arch.attention_width, arch.kv_width, arch.intermediate, arch.heads
    full = method == "full"
    stream = 0.0  # residual stream, norms, dropout copies
    masks = 0.0  # dropout keep masks, one byte per element
    matmul = 2 * a + 2 * kv + heads + 3 * i  # attention q, k, v, out, lse; gate, act, up
    stream += (h + 1) * (2 if grad_reaches_input else 1)  # normalised values and 1/rms (layer 0 of an adapter: norm 2 only)
    groups = {  # a shared input tensor and the linear layers reading it
        "attn_in": (h, ("q_proj", "k_proj", "v_proj"), "stream"),
        "attn_out": (a, ("o_proj",), "matmul"),
        "mlp_in": (h, ("gate_proj", "up_proj"), "stream"),
        "mlp_mid": (i, ("down_proj",), "matmul"),
    }
    for group, (width, readers, kind) in groups.items():
        keeps_shared = False
        for name in readers:
            if full:
                keeps_shared = True
            elif name in adapted:
                if dropout > 0 and dropout_bits:
                    keeps_shared = True
                    masks += 2 * width  # 16-bit random numbers, turned into the keep mask again in backward
                elif dropout > 0:
                    stream += width if kind == "stream" else 0
                    matmul += width if kind == "matmul" else 0
                    if grad_reaches_input or group != "attn_in":  # the mask serves the input's gradient only
                        masks += width
                else:
                    keeps_shared = True
                matmul += r
                if dora:
                    matmul += arch.linear_shapes()[name][1]
        if keeps_shared:
            if kind == "stream":
                stream += width
            else:
                matmul += width
    return stream, matmul, masks


def optimizer_state_bytes(t, m, arch: Architecture) -> float:
    """Bytes of optimizer state per trained parameter for ``train.optimizer``."""
    absmax = 4 / ADAM_8BIT_BLOCK  # 8-bit states keep one fp32 scale per block
    if t.optimizer in ("adamw_8bit", "paged_adamw_8bit"):
        return 2 * (1 + absmax)
    if t.optimizer == "adafactor":
        # A (rows × cols) matrix keeps rows + cols fp32 numbers; an adapter matrix has r on one side.
        return 4 * (1 / m.r + 1 / arch.hidden) if m.name != "full" else 4 * 2 / arch.hidden
    return {"lion": 4, "lion_8bit": 1 + absmax, "sgd": 4 if t.sgd_momentum else 0}.get(t.optimizer, 8)  # AdamW kinds: 2 moments


def activation_bytes(arch: Architecture, cfg: RunConfig, adapted: set, tokens: int, stream_dtype: int,
                     matmul_dtype: int, every: int = 1) -> Tuple[float, float, List[str]]:
    """(without checkpointing, with checkpointing of every ``every``-th layer, notes) for one micro-batch of ``tokens`` tokens."""
    m = cfg.method
    notes: List[str] = []
    dora = m.name != "full" and (m.use_dora or m.name == "dora")
    # The fused path's condition (ftctl.methods.fused_lora): plain LoRA, fp32 without autocast, on a CPU.
    dropout_bits = m.name == "lora" and not dora and stream_dtype == matmul_dtype == 4 and not gpu_visible()
    args = (arch, m.name, adapted, m.dropout, m.r, dora)
    stream, matmul, masks = layer_activation_elements(*args, grad_reaches_input=True, dropout_bits=dropout_bits)
    per_layer = tokens * (stream_dtype * stream + matmul_dtype * matmul + masks)
    if m.name == "full":
        layers = arch.layers * per_layer
    else:  # the frozen embedding sends no gradient into the first layer
        s0, m0, masks0 = layer_activation_elements(*args, grad_reaches_input=False, dropout_bits=dropout_bits)
        layers = (arch.layers - 1) * per_layer + tokens * (stream_dtype * s0 + matmul_dtype * m0 + masks0)
    if dora:
        notes.append("dora: activations approximate (DoRA's weight-norm terms counted as one output per layer)")

    h, v, i = arch.hidden, arch.vocab, arch.intermediate
    head_trains = m.name == "full" or any(n.endswith("lm_head") for n in m.modules_to_save)
    head = tokens * stream_dtype * (h + 1)  # final norm
    if arch.model_type in HEAD_RETURNS_PLAIN_LOGITS:
        # Chunked loss: the gradient for the hidden states, one chunk of logits, the head's gradient.
        head += tokens * h * 4 + min(tokens, max(1, LOSS_CHUNK_ELEMENTS // v)) * v * 4
        head += v * h * 4 if head_trains else 0
    else:
        head += 2 * tokens * v * 4  # full fp32 logits and their log-softmax
        notes.append(f"model_type={arch.model_type or '?'}: the loss materialises full (tokens, vocabulary) logits")
    # Backward working set: the gradient of the residual stream and of one MLP's intermediates.
    working = tokens * (2 * h * stream_dtype + 2 * i * matmul_dtype)
    without = layers + head + working
    # Checkpointing keeps each checkpointed layer's input and recomputes one layer at a time in backward;
    # the layers left out (every > 1) keep all of theirs.
    checkpointed = math.ceil(arch.layers / every)
    kept_whole = layers * (arch.layers - checkpointed) / arch.layers
    with_ckpt = checkpointed * tokens * h * stream_dtype + kept_whole + per_layer + head + working
    return without, with_ckpt, notes


# --------------------------------------------------------------------------------------------- output


def _size(n: float) -> str:
    for unit, scale in (("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if abs(n) >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,.0f} B"


def format_table(est: MemoryEstimate) -> str:
    world = f"× {est.world_size} rank{'s' if est.world_size > 1 else ''}"
    lines = [
        f"memory per rank: method={est.method} parallel={est.parallel} {world} precision={est.precision}",
        f"  model {est.model}: {est.parameters:,} parameters, {est.trainable_parameters:,} trainable",
        f"  activations for micro_batch_size {est.micro_batch_size} × max_seq_len {est.seq_len} tokens",
        "",
        f"  {'weights':<38} {_size(est.weights_bytes):>12}",
        f"  {'gradients':<38} {_size(est.gradients_bytes):>12}",
        f"  {'optimizer states':<38} {_size(est.optimizer_bytes):>12}",
    ]
    if est.mesh:
        lines.append(f"  {'activations' + (', gradient checkpointing' if est.gradient_checkpointing else ''):<38} "
                     f"{_size(est.activations_bytes):>12}")
    else:
        lines += [
            f"  {'activations, no checkpointing':<38} {_size(est.activations_without_checkpointing_bytes):>12}"
            + ("" if est.gradient_checkpointing else "  <- this run"),
            f"  {'activations, gradient checkpointing':<38} {_size(est.activations_with_checkpointing_bytes):>12}"
            + ("  <- this run" if est.gradient_checkpointing else ""),
        ]
    if est.gathered_bytes:
        lines.append(f"  {'gathered weights (layers in use)':<38} {_size(est.gathered_bytes):>12}")
    if est.buffers_bytes:
        lines.append(f"  {'gradient reduction buckets':<38} {_size(est.buffers_bytes):>12}")
    lines.append(f"  {'total':<38} {_size(est.total_bytes):>12}")
    if est.offloaded_bytes:
        lines.append(f"  {'offloaded to CPU memory':<38} {_size(est.offloaded_bytes):>12}")
    if len(est.stage_totals_bytes) > 1:
        lines.append("  per pipeline rank: " + ", ".join(f"{r}: {_size(b)}" for r, b in enumerate(est.stage_totals_bytes)))
    lines += [f"  note: {n}" for n in est.notes]
    return "\n".join(lines)


def mesh_model_refusal(cfg: RunConfig):
    """What the model's shipped or local config.json rules out for this mesh (too many stages, tied embeddings
    under a pipeline), before anything loads; None when fine or when no config is at hand (the backend checks again)."""
    from ftctl.parallel.mesh_shape import check_stage_count, tied_embeddings_refusal

    if cfg.parallel.name != "mesh":
        return None
    try:
        config, _ = load_model_config(cfg)
    except ConfigError:
        return None
    text = config.get("text_config", config) if "num_hidden_layers" not in config else config
    return check_stage_count(cfg, text.get("num_hidden_layers")) or tied_embeddings_refusal(cfg, bool(text.get("tie_word_embeddings")))


def estimate_for(cfg: RunConfig) -> MemoryEstimate:
    config, source = load_model_config(cfg)
    return estimate_memory(cfg, config, source)


def to_json(est: MemoryEstimate) -> str:
    return json.dumps(est.to_dict(), indent=2)
