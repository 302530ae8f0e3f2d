"""The 4-bit base of QLoRA: bitsandbytes settings, loading for k-bit training, and the way back to full precision.

The settings that quantised a base are recorded next to its adapter (:class:`QuantSettings`), so
``ftctl merge`` can rebuild exactly the 4-bit weights the adapter was trained against and
dequantise them, instead of merging into weights the adapter never saw.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

import torch

from ftctl.errors import FtctlError
from ftctl.models.loading import load_causal_lm

STORAGE_DTYPES = {"uint8": torch.uint8, "bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}


def dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class QuantSettings:
    quant_type: str  # nf4 or fp4
    double_quant: bool
    quant_storage: str  # a key of STORAGE_DTYPES
    compute_dtype: str  # the dtype the base was loaded in and dequantises to in the forward pass

    @classmethod
    def from_method(cls, method_cfg, compute_dtype: torch.dtype) -> "QuantSettings":
        return cls(method_cfg.quant_type, method_cfg.double_quant, method_cfg.quant_storage, dtype_name(compute_dtype))

    @classmethod
    def from_dict(cls, data: dict) -> "QuantSettings":
        return cls(**{key: data[key] for key in ("quant_type", "double_quant", "quant_storage", "compute_dtype")})

    def to_dict(self) -> dict:
        return asdict(self)

    @property
    def torch_compute_dtype(self) -> torch.dtype:
        return getattr(torch, self.compute_dtype)

    def bnb_config(self):
        from transformers import BitsAndBytesConfig

        return BitsAndBytesConfig(
            load_in_4bit=True,
            bnb_4bit_quant_type=self.quant_type,
            bnb_4bit_use_double_quant=self.double_quant,
            bnb_4bit_compute_dtype=self.torch_compute_dtype,
            bnb_4bit_quant_storage=STORAGE_DTYPES[self.quant_storage],
        )


def _require_bitsandbytes() -> None:
    try:
        import bitsandbytes  # noqa: F401
    except ImportError as exc:
        raise FtctlError(f"method=qlora needs bitsandbytes (pip install bitsandbytes): {exc}") from None


def load_4bit(model_cfg, model_path: str, settings: QuantSettings, device: torch.device, attention=None):
    """The base with every linear layer but the output head quantised to 4 bits, on ``device``."""
    _require_bitsandbytes()
    # Quantisation happens while the weights are placed, so they go straight to the training device.
    model = load_causal_lm(
        model_cfg, model_path, dtype=settings.torch_compute_dtype,
        quantization_config=settings.bnb_config(), device_map={"": str(device)},
        attention=attention,
    )
    keep_one_weight_layout(model)
    return model


def keep_one_weight_layout(model) -> int:
    """Turn off bitsandbytes' in-place repacking of 4-bit weights for AVX512-BF16 CPUs; returns the layers touched.

    On such a CPU, bitsandbytes rewrites a layer's packed weight into another layout the first time
    the layer runs without gradients (an eval pass, the packing check) and computes in bf16 from then
    on. The next training forward then fails (``assert module.weight.shape[1] == 1``) or sees
    different numbers than an AVX2 CPU would. One layout keeps training, eval and merge identical on
    every CPU.
    """
    touched = 0
    for module in model.modules():
        if getattr(module, "support_avx512bf16_for_cpu", False):
            module.support_avx512bf16_for_cpu = False
            touched += 1
    return touched


def prepare_for_kbit_training(model, gradient_checkpointing: bool):
    """Freeze the base and checkpoint activations if asked; the unquantised weights stay in the compute dtype.

    peft's ``prepare_model_for_kbit_training`` also casts every unquantised weight (embeddings,
    norms, the output head) to fp32. With an fp32 embedding the whole residual stream runs in fp32:
    every layer then saves fp32 activations for backward, and autocast saves a bf16 copy of each
    matmul input next to them, which made QLoRA hold more than LoRA at the same batch. Frozen
    weights in the compute dtype are what LoRA trains against too (PrecisionPolicy.frozen_weight_dtype).
    """
    model.requires_grad_(False)
    if gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    return model


def load_dequantized(model_cfg, model_path: str, settings: QuantSettings, dtype: torch.dtype = torch.float32):
    """The base as a QLoRA adapter saw it in training: quantised with ``settings``, then expanded back to ``dtype``.

    Loaded on the CPU: a merge needs no accelerator, and the 4-bit codes are the same on every device.
    """
    model = load_4bit(model_cfg, model_path, settings, torch.device("cpu"))
    model = model.dequantize(dtype=dtype)
    # Layers left unquantised (embeddings, norms, head) are still in the load dtype.
    return model.to(dtype)
