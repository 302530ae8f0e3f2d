"""Which method × backend × precision × offload combinations ftctl runs, and why the others are refused.

Consulted before anything is loaded or launched: :func:`config_refusal` needs only the config (it
runs inside config validation), :func:`device_refusal` also needs the device kind the run will
train on. Every refusal names the reason and a way out.
"""

from __future__ import annotations

import importlib.util
import math
from typing import Optional

from ftctl.errors import ConfigError

ZERO_STAGES = ("zero1", "zero2", "zero3")
SHARDED = ("fsdp", "zero3")  # backends that partition the parameters themselves

#: The dir each sharding backend keeps its own state in inside an ftctl checkpoint dir (weights'
#: shards and optimizer state); single and ddp write optimizer.rank<N>.pt files instead.
CHECKPOINT_STATE_DIRS = {"fsdp": "fsdp_state", "mesh": "mesh_state", **{stage: "deepspeed" for stage in ZERO_STAGES}}
#: The DeepSpeed config a ZeRO run writes into its run dir.
DEEPSPEED_CONFIG_FILE = "deepspeed_config.json"


def bucket_elements(hidden_size: int) -> int:
    """Elements per DeepSpeed gradient-reduction and all-gather bucket: hidden², as transformers' "auto" sets it.

    DeepSpeed's default, 5e8 elements, is 1.9 GiB of fp32 buffer on every device whatever the model.
    """
    return hidden_size * hidden_size


#: Optimizers that cannot run inside DeepSpeed ZeRO, and why. ZeRO hands its client optimizer flat
#: fp32 partitions (several tensors joined, cut at rank boundaries) and keeps them apart from the
#: module's weights.
ZERO_REFUSED_OPTIMIZERS = {
    "adafactor": "DeepSpeed hands the optimizer flat partitions of joined tensors, so Adafactor can neither factor "
                 "each matrix's second moment nor scale its step by each matrix's RMS; use parallel=ddp",
    "schedule_free_adamw": "DeepSpeed updates its own fp32 copy of the weights, so the switch to the averaged weights "
                           "for eval and saving would not reach the model; use parallel=ddp or fsdp",
}

_BITSANDBYTES_ON_DTENSORS = ("bitsandbytes' update kernels take plain tensors, not FSDP's DTensor shards; use "
                             "parallel=ddp or zero1/2/3 (ZeRO hands the optimizer plain partitions), or train.optimizer=adamw")
#: Optimizers that cannot update FSDP2's DTensor parameters, and why.
FSDP_REFUSED_OPTIMIZERS = {
    **{name: _BITSANDBYTES_ON_DTENSORS for name in ("adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit", "lion", "lion_8bit")},
    "adafactor": "torch's Adafactor cannot compute its factored statistics on FSDP's DTensor shards (an in-place op "
                 "on a partial reduction); use parallel=ddp",
}


#: Axes only a mesh has: set on another backend they are refused, never ignored.
MESH_AXES = ("tp_size", "pp_size", "ep_size")


def mesh_refusal(cfg) -> Optional[str]:
    """Why these mesh sizes cannot run (on any backend), or None."""
    from ftctl.parallel.mesh_shape import PP_SCHEDULES, mesh_shape

    p, m = cfg.parallel, cfg.method
    axes = {key: getattr(p, key) for key in MESH_AXES if getattr(p, key) != 1}
    if p.name != "mesh":
        if not axes and p.dp_shard_size == -1 and p.dp_replicate_size == 1:
            return None
        key, size = next(iter(axes.items())) if axes else ("dp_shard_size", p.dp_shard_size)
        setting = f"parallel={p.name} with parallel.{key}={size}"
        if p.name in ZERO_STAGES and p.pp_size > 1:
            return (f"{setting}: DeepSpeed ZeRO does not run pipeline stages; use parallel=mesh (recipes parallel=pp, 3d), "
                    "which shards the data-parallel axis with FSDP2")
        if p.name == "ddp" and p.tp_size > 1:
            return (f"{setting}: plain DDP replicates whole modules and cannot hold tensor-parallel shards; use "
                    "parallel=mesh (recipes parallel=tp, fsdp_tp), which runs the data-parallel axis with FSDP2")
        return f"{setting}: mesh axes need parallel=mesh (recipes parallel=tp, pp, fsdp_tp, 3d)"
    if p.pp_schedule not in PP_SCHEDULES:
        return f"parallel.pp_schedule='{p.pp_schedule}' is not one of {', '.join(PP_SCHEDULES)}"
    if p.pp_microbatches < 0 or p.pp_stages_per_rank < 1:
        return "parallel.pp_microbatches must be >= 0 and parallel.pp_stages_per_rank >= 1"
    try:
        shape = mesh_shape(p, p.nproc_per_node * p.nnodes)
    except ValueError as exc:
        return str(exc)
    if p.offload_params or p.offload_optimizer:
        return "parallel=mesh does not offload to the CPU; use parallel=fsdp with parallel.offload_params=cpu, or zero3"
    if cfg.precision.name == "fp16":
        return ("parallel=mesh precision=fp16: the loss scaler does not run over tensor- and pipeline-parallel shards; "
                "use precision=bf16 (or fp16 with parallel=fsdp)")
    if m.name == "qlora" and (shape.tp > 1 or shape.ep > 1):
        return (f"method=qlora with parallel.{'tp' if shape.tp > 1 else 'ep'}_size>1: bitsandbytes' 4-bit weights cannot be "
                "split into tensor- or expert-parallel shards; use method=lora (or QLoRA with pp_size and FSDP2 only)")
    if cfg.train.neftune_alpha and shape.tp > 1:
        return (f"train.neftune_alpha={cfg.train.neftune_alpha} with parallel.tp_size={shape.tp}: the embeddings are split "
                "over the vocabulary and each tp rank's partial output is summed after NEFTune's hook would add noise "
                "to it; set train.neftune_alpha=0, or use a mesh without tp (pp, ep, FSDP)")
    if m.name != "full" and shape.ep > 1 and list(m.target_modules) == ["all-linear"] and not (m.use_dora or m.name == "dora"):
        return ("parallel.ep_size>1 with method.target_modules=[all-linear]: all-linear reaches the fused expert weights, "
                "whose LoRA peft does not shard by expert; name linear layers (e.g. [q_proj,k_proj,v_proj,o_proj]) or use method=full")
    if shape.pp > 1:
        if cfg.data.packing:
            return ("data.packing=true with parallel.pp_size>1: pipeline stages pass fixed-shape activations, so micro-batches "
                    "are padded to data.max_seq_len; set data.packing=false")
        if shape.ep > 1:
            return "parallel.ep_size>1 with parallel.pp_size>1: transformers' expert dispatch does not run inside pipeline stages yet"
        if p.pp_schedule == "interleaved_1f1b" and p.pp_stages_per_rank < 2:
            return "parallel.pp_schedule=interleaved_1f1b needs parallel.pp_stages_per_rank >= 2 (1 is plain 1f1b)"
        t = cfg.train
        rows = t.global_batch_size // shape.dp  # each data-parallel rank's share of a step, cut into pipeline micro-batches
        if p.pp_microbatches and (t.global_batch_size % shape.dp or rows % p.pp_microbatches):
            return (f"parallel.pp_microbatches={p.pp_microbatches} must divide the {rows} examples each pipeline takes a step "
                    f"(train.global_batch_size {t.global_batch_size} ÷ {shape.dp} data-parallel ranks); 0 uses the "
                    "gradient accumulation steps")
    return None


def config_refusal(cfg) -> Optional[str]:
    """A reason this config cannot run anywhere, or None."""
    p, m = cfg.parallel, cfg.method
    reason = mesh_refusal(cfg)
    if reason:
        return reason
    if p.rdzv_backend not in ("static", "c10d"):
        return f"parallel.rdzv_backend='{p.rdzv_backend}' is not one of static, c10d"
    if p.zero3_persistence_threshold < 0:
        return f"parallel.zero3_persistence_threshold={p.zero3_persistence_threshold} must be >= 0"
    if p.offload_optimizer == "cpu" and p.name not in ZERO_STAGES:
        if p.name == "fsdp":
            return ("parallel=fsdp offloads parameters, gradients and optimizer state together: "
                    "set parallel.offload_params=cpu instead of parallel.offload_optimizer")
        return (f"parallel={p.name} keeps the whole optimizer on each device; optimizer offload needs "
                f"parallel=zero1, zero2 or zero3 with parallel.offload_optimizer=cpu")
    if p.offload_params == "cpu" and p.name not in SHARDED:
        return (f"parallel.offload_params=cpu needs a backend that partitions parameters (fsdp or zero3); "
                f"parallel={p.name} keeps them whole on every device")
    if m.name == "qlora" and p.offload_params == "cpu":
        return ("method=qlora with parallel.offload_params=cpu: ftctl does not offload bitsandbytes 4-bit weights "
                "(their quantisation state stays with the layer on the device); the 4-bit base is already a quarter "
                "of its bf16 size, so drop the parameter offload or use method=lora")
    # A mesh's parameters are DTensors (tensor-parallel and FSDP2 shards) as FSDP's are.
    refused = (ZERO_REFUSED_OPTIMIZERS if p.name in ZERO_STAGES else FSDP_REFUSED_OPTIMIZERS if p.name in ("fsdp", "mesh") else {})
    if cfg.train.optimizer in refused:
        return f"train.optimizer={cfg.train.optimizer} with parallel={p.name}: {refused[cfg.train.optimizer]}"
    if p.name in ZERO_STAGES and cfg.precision.name == "fp16":
        power = math.log2(cfg.precision.init_scale) if cfg.precision.init_scale > 0 else 0.5
        if power != int(power):
            return (f"precision.init_scale={cfg.precision.init_scale}: DeepSpeed's loss scaler starts at a power of "
                    f"two; use {2 ** round(power) if power > 0 else 65536.0}")
    return None


#: The package each flash-attention kernel of transformers imports.
FLASH_ATTENTION_PACKAGES = {"flash_attention_2": "flash_attn", "flash_attention_3": "flash_attn_interface"}


#: Optimizers that come from a package outside torch: (the module, the ftctl extra that installs it).
OPTIMIZER_PACKAGES = {
    **{name: ("bitsandbytes", "quant") for name in ("adamw_8bit", "paged_adamw_8bit", "paged_adamw_32bit", "lion", "lion_8bit")},
    "schedule_free_adamw": ("schedulefree", "optim"),
}


def optimizer_refusal(optimizer: str, device_type: str) -> Optional[str]:
    if optimizer.startswith("paged_") and device_type != "cuda":
        return (f"train.optimizer={optimizer} needs a CUDA device: bitsandbytes pages optimizer state through "
                f"CUDA unified memory, which {device_type} does not have; use train.optimizer=adamw_8bit or adamw")
    package, extra = OPTIMIZER_PACKAGES.get(optimizer, (None, None))
    if package and importlib.util.find_spec(package) is None:
        return f"train.optimizer={optimizer} needs {package}, which is not installed: pip install 'ftctl[{extra}]'"
    return None


def kernels_refusal(kernels: str, device_type: str) -> Optional[str]:
    if kernels != "liger":
        return None
    if device_type != "cuda":
        return (f"train.kernels=liger runs liger-kernel's Triton kernels, which need a CUDA GPU; on "
                f"{device_type.upper()} use train.kernels=ftctl (the default)")
    if importlib.util.find_spec("liger_kernel") is None:
        return "train.kernels=liger needs liger-kernel, which is not installed: pip install 'ftctl[liger]'"
    return None


def device_refusal(cfg, device_type: str) -> Optional[str]:
    """A reason this config cannot run on ``device_type`` ('cuda' or 'cpu'), or None."""
    p = cfg.parallel
    kernel = cfg.model.attn_implementation
    if kernel in FLASH_ATTENTION_PACKAGES:
        if device_type != "cuda":
            return f"model.attn_implementation={kernel} runs only on CUDA GPUs; use auto (the default) or sdpa on {device_type.upper()}"
        if importlib.util.find_spec(FLASH_ATTENTION_PACKAGES[kernel]) is None:
            return (f"model.attn_implementation={kernel} needs the {FLASH_ATTENTION_PACKAGES[kernel]} package, "
                    f"which is not installed; install flash-attn or use sdpa")
    refusal = optimizer_refusal(cfg.train.optimizer, device_type) or kernels_refusal(cfg.train.kernels, device_type)
    if refusal:
        return refusal
    if p.name in ZERO_STAGES:
        if importlib.util.find_spec("deepspeed") is None:
            return f"parallel={p.name} needs DeepSpeed: pip install 'ftctl[deepspeed]'"
        if cfg.precision.name == "fp16" and device_type != "cuda":
            return (f"parallel={p.name} precision=fp16: DeepSpeed's fp16 mode (with its dynamic loss scaler) runs "
                    f"only on GPUs; on {device_type.upper()} use precision=fp32 or bf16, or fp16 with parallel=ddp or fsdp")
    if p.dist_backend == "nccl" and device_type != "cuda":
        return "parallel.dist_backend=nccl needs CUDA GPUs; use gloo (or auto) on CPU"
    return None


def training_device_type() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def check_supported(cfg, device_type: Optional[str] = None) -> None:
    """Raise ConfigError with the reason when this combination is not run by ftctl."""
    reason = config_refusal(cfg) or device_refusal(cfg, device_type or training_device_type())
    if reason:
        raise ConfigError(reason)
