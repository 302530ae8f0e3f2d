"""DeepSpeed ZeRO stages 1-3 through ``deepspeed.initialize``, with a config generated from ftctl's own.

Stage 1 partitions optimizer states over the ranks, stage 2 also gradients, stage 3 also the
parameters themselves. The generated DeepSpeed config is written to the run dir
(``deepspeed_config.json``) so a run can be inspected or reproduced with DeepSpeed's own tools.

The runner drives gradient accumulation (one ``backward`` per micro-batch, one ``step`` per global
batch, the loss already normalised by the global batch's tokens), so DeepSpeed runs in its
caller-managed accumulation mode and never rescales the loss by the accumulation steps.
bf16 runs under the runner's autocast with fp32 weights, as on every backend; fp16 uses DeepSpeed's
own fp16 mode with its dynamic loss scaler (fp32 master weights in the optimizer partitions).
"""

from __future__ import annotations

import importlib
import json
import math
import os
import warnings
from pathlib import Path
from typing import Dict, Optional

import torch

from ftctl.config.validate import gradient_accumulation_steps
from ftctl.errors import FtctlError
from ftctl.parallel.base import Engine, StepResult
from ftctl.parallel.distributed import DataParallelBackend
from ftctl.parallel.support import CHECKPOINT_STATE_DIRS, DEEPSPEED_CONFIG_FILE, bucket_elements

CONFIG_FILE = DEEPSPEED_CONFIG_FILE
STATE_DIR = CHECKPOINT_STATE_DIRS["zero1"]  # DeepSpeed's own checkpoint layout inside an ftctl checkpoint dir
STATE_TAG = "state"
STAGES = {"zero1": 1, "zero2": 2, "zero3": 3}


def import_deepspeed():
    on_cpu = not torch.cuda.is_available()
    if on_cpu:
        # Without it DeepSpeed looks for a CUDA toolkit and fails on CPU-only machines.
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    try:
        import deepspeed

        # By module path: the package attribute `deepspeed.comm.torch` is torch itself.
        ds_torch_comm = importlib.import_module("deepspeed.comm.torch")
    except ImportError as exc:
        raise FtctlError(f"ZeRO backends need DeepSpeed ({exc}); install it with: pip install 'ftctl[deepspeed]'") from None
    # DeepSpeed calls collectives torch has renamed, once per bucket; nothing a user can act on.
    warnings.filterwarnings("ignore", message=r"`torch\.distributed\.\w+` is deprecated", category=FutureWarning)
    if on_cpu:
        # On CPU ranks DeepSpeed JIT-compiles a shared-memory all-reduce kernel on first use (minutes
        # of C++ compilation, and a compiler on the machine); gloo, which carries everything else, does the job.
        ds_torch_comm.build_shm_op = lambda: None
    return deepspeed


def deepspeed_config(cfg, stage: int, precision_name: str, world_size: int, on_gpu: bool, hidden_size: int) -> dict:
    """The DeepSpeed JSON config equivalent to an ftctl run config."""
    t, p = cfg.train, cfg.parallel
    bucket = bucket_elements(hidden_size)
    zero: Dict[str, object] = {
        "stage": stage,
        # Caller-managed accumulation allows overlapped reduction only in stage 2.
        "overlap_comm": stage == 2 and on_gpu,
        "contiguous_gradients": True,
        "reduce_bucket_size": bucket,
        "allgather_bucket_size": bucket,
    }
    if p.offload_optimizer == "cpu":
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": on_gpu}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = p.zero3_persistence_threshold
        zero["stage3_gather_16bit_weights_on_model_save"] = False  # ftctl gathers fp32 weights itself
        if p.offload_params == "cpu":
            zero["offload_param"] = {"device": "cpu", "pin_memory": on_gpu}
    config = {
        "train_batch_size": t.global_batch_size,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": gradient_accumulation_steps(cfg, world_size),
        "managed_gradient_accumulation": False,
        "gradient_clipping": t.max_grad_norm,
        "zero_optimization": zero,
        "fp16": {"enabled": False},
        "bf16": {"enabled": False},
        # ftctl's AdamW (torch's) is used as is, also for CPU-offloaded partitions.
        "zero_allow_untested_optimizer": True,
        "zero_force_ds_cpu_optimizer": False,
        "steps_per_print": 2**31 - 1,
        "wall_clock_breakdown": False,
    }
    if precision_name == "fp16":
        config["fp16"] = {
            "enabled": True,
            "loss_scale": 0,  # dynamic
            "initial_scale_power": int(math.log2(cfg.precision.init_scale)),
            "loss_scale_window": cfg.precision.growth_interval,
            # Back off on every overflow, as torch's GradScaler does.
            "hysteresis": 1,
            "min_loss_scale": 1,
        }
    return config


class DeepSpeedZeroEngine(Engine):
    def __init__(self, ds_engine, model: torch.nn.Module, stage: int, is_main: bool, fp16: bool):
        self.ds, self.module, self.optimizer = ds_engine, ds_engine, ds_engine.optimizer
        self.model, self.stage, self.is_main, self.fp16 = model, stage, is_main, fp16

    def backward(self, loss):
        self.ds.backward(loss, scale_wrt_gas=False)

    def step(self, max_grad_norm, sync):
        # Clipping to max_grad_norm is part of the DeepSpeed config; DeepSpeed zeroes the gradients. Its norm is
        # already global (and read back, as DeepSpeed's overflow checks are); the step's totals still reduce once.
        self.ds.step()
        norm = self.ds.get_global_grad_norm()
        _, grad_norm = sync(torch.as_tensor(norm if norm is not None else float("nan"), dtype=torch.float32), sharded=False)
        skipped = not self.ds.was_step_applied()
        self.skipped_steps += skipped
        return StepResult(grad_norm, skipped)

    def loss_scale(self) -> Optional[float]:
        return float(self.optimizer.cur_scale) if self.fp16 else None

    def gathered_state_dict(self):
        """fp32 weights on rank 0: trained ones from the optimizer's fp32 partitions, frozen ones gathered."""
        from deepspeed import zero
        from deepspeed.utils import safe_get_full_fp32_param

        state, gathered = {}, {}
        params = dict(self.model.named_parameters(remove_duplicate=False))
        for key, value in self.model.state_dict().items():
            param = params.get(key)
            if param is None:  # a buffer: never partitioned
                if self.is_main:
                    state[key] = value.detach().cpu()
                continue
            if id(param) not in gathered:
                full = safe_get_full_fp32_param(param) if param.requires_grad else None  # collective
                if full is None:
                    with zero.GatheredParameters([param], enabled=self.stage == 3):  # collective in stage 3
                        full = param.detach().clone()
                gathered[id(param)] = full.cpu() if self.is_main else None
            if self.is_main:
                state[key] = gathered[id(param)]
        return state if self.is_main else None

    def save_training_state(self, ckpt_dir, rank):
        # The optimizer partitions hold the fp32 master weights, so DeepSpeed saves module and optimizer together.
        self.ds.save_checkpoint(str(Path(ckpt_dir) / STATE_DIR), tag=STATE_TAG, save_latest=False, exclude_frozen_parameters=True)

    def load_training_state(self, ckpt_dir, rank):
        path, _ = self.ds.load_checkpoint(
            str(Path(ckpt_dir) / STATE_DIR), tag=STATE_TAG, load_module_strict=False,
            load_optimizer_states=True, load_lr_scheduler_states=False,
        )
        if path is None:
            raise FtctlError(f"{ckpt_dir}: no DeepSpeed training state to resume from")


class DeepSpeedZeroBackend(DataParallelBackend):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.stage = STAGES[cfg.parallel.name]
        self.deepspeed = import_deepspeed()
        # Reuses the process group that is already up; DeepSpeed's comm layer only wraps it.
        self.deepspeed.init_distributed(dist_backend=None, auto_mpi_discovery=False, verbose=False, dist_init_required=False)

    def prepare(self, model, make_optimizer, precision):
        config = deepspeed_config(self.cfg, self.stage, precision.name, self.world_size, self.device.type == "cuda",
                                  model.config.hidden_size)
        if self.is_main:
            run_dir = Path(self.cfg.output_dir).expanduser()
            run_dir.mkdir(parents=True, exist_ok=True)
            (run_dir / CONFIG_FILE).write_text(json.dumps(config, indent=2) + "\n")
        ds_engine, _, _, _ = self.deepspeed.initialize(model=model, optimizer=make_optimizer(model), config=config, dist_init_required=False)
        return DeepSpeedZeroEngine(ds_engine, model, self.stage, self.is_main, precision.name == "fp16")
