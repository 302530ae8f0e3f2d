"""Which attention a model runs: one decision, by the model class, the machine and the precision.

:func:`choose_attention` answers two questions together, before anything loads: the
``attn_implementation`` the model loads with, and, for packed runs, the kernel packed micro-batches
run through (:mod:`ftctl.models.packed_attention`). They cannot be chosen apart: a packed kernel
replaces ``sdpa`` attention, so a model loaded with another implementation never runs it, and
transformers' own packed path (``flash_attention_2`` without ftctl's boundaries) reads
``position_ids`` back to the host on every forward to find the examples.

- ``model.attn_implementation=auto`` loads ``sdpa`` where the model class has it, else ``eager``.
  The class's own capability flags decide (``_supports_sdpa``, ``_supports_flash_attn``), not a list
  of names: Gemma2 and GPT-OSS have no SDPA path (soft-capped or sink attention).
- A packed run on ``sdpa`` takes the fastest packed kernel the machine has that takes the run's
  precision: flash-attention's and torch's varlen kernels take only fp16/bf16, so an fp32 run falls
  to FlexAttention or per-example SDPA, and the log says why. A kernel asked for by name that
  cannot run is refused here, in one line.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Tuple

from ftctl.errors import ConfigError, FtctlError
from ftctl.models.packed_attention import HALF_PRECISION_ONLY, KERNEL_NEEDS, NO_DROPOUT, PACKED_KERNELS, KernelCapabilities

AUTO = "auto"


def causal_lm_class(config):
    """The transformers class AutoModelForCausalLM builds for ``config``, or None (remote code, unknown type)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except (KeyError, ValueError):
        return None


@dataclass(frozen=True)
class AttentionChoice:
    """The answer of :func:`choose_attention`."""

    implementation: Optional[str]  # from_pretrained's attn_implementation; None lets transformers pick
    packed_kernel: Optional[str] = None  # what packed micro-batches run; None: not packing, or not on sdpa
    device_type: str = "cpu"
    passed_over: Tuple[str, ...] = ()  # faster kernels this machine has that the run cannot use, with the reason

    def describe(self, ran: Optional[set] = None) -> str:
        """The log line's text; ``ran``: the packed kernels that actually ran (see ``record_packed_kernels``)."""
        if self.packed_kernel is None:
            return (f"attn_implementation={self.implementation or 'transformers default'} keeps packed examples apart "
                    f"itself (from the restarting position_ids, read back on every forward); ftctl's packed kernels replace sdpa only")
        ran = sorted(ran) if ran is not None else [self.packed_kernel]
        text = f"{'+'.join(ran) or 'no'} kernel on {self.device_type}"
        if ran != [self.packed_kernel]:
            text += f" (chosen: {self.packed_kernel})"
        return text + "".join(f"; {note}" for note in self.passed_over)


def choose_packed_kernel(caps: KernelCapabilities, requested: str = AUTO, *, precision: str = "bf16",
                         dropout: float = 0.0) -> Tuple[str, Tuple[str, ...]]:
    """The packed kernel to run and the faster ones passed over, each with its reason.

    ``requested`` other than ``auto`` is taken or refused; ``auto`` is the fastest kernel the machine
    has that takes ``precision`` and the model's attention ``dropout``. The CPU keeps per-example SDPA.
    """
    reasons = {k: _unusable(k, caps, precision, dropout) for k in PACKED_KERNELS}
    if requested != AUTO:
        why = reasons.get(requested, "is not a packed kernel")
        if why is not None:
            fallback, _ = choose_packed_kernel(caps, AUTO, precision=precision, dropout=dropout)
            instead = "precision=bf16, or " if requested in HALF_PRECISION_ONLY and caps.available(requested) else ""
            raise ConfigError(f"data.packed_attention={requested} {why}; use {instead}data.packed_attention={AUTO} "
                              f"(it picks {fallback} here)")
        return requested, ()
    chosen = next(k for k in PACKED_KERNELS if reasons[k] is None)
    faster = PACKED_KERNELS[: PACKED_KERNELS.index(chosen)]
    return chosen, tuple(f"{k} passed over: it {reasons[k]}" for k in faster if caps.available(k))


def _unusable(kernel: str, caps: KernelCapabilities, precision: str, dropout: float) -> Optional[str]:
    if not caps.available(kernel):
        return f"needs {KERNEL_NEEDS.get(kernel, 'a known kernel')}"
    if kernel in HALF_PRECISION_ONLY and precision not in ("bf16", "fp16"):
        return f"takes only fp16/bf16 inputs and precision is {precision}"
    if kernel in NO_DROPOUT and dropout:
        return f"has no attention dropout and the model's attention_dropout is {dropout:g}"
    return None


def choose_attention(requested: str, config, *, packing: bool = False, packed_request: str = AUTO,
                     caps: Optional[KernelCapabilities] = None, precision: str = "fp32") -> AttentionChoice:
    """The ``attn_implementation`` to load with and, when ``packing``, the packed kernel; see the module docstring.

    An explicit implementation the model class lacks, or a packed kernel that cannot run, is refused
    in one line.
    """
    model_class = causal_lm_class(config)
    implementation = _implementation(requested, model_class)
    device_type = caps.device_type if caps is not None else "cpu"
    if not packing:
        return AttentionChoice(implementation, device_type=device_type)
    # None: transformers picks, and it picks sdpa where the class has it.
    if implementation not in ("sdpa", None):
        if packed_request != AUTO:
            raise ConfigError(f"data.packed_attention={packed_request} runs in place of sdpa attention, but the model "
                              f"loads with {implementation} (model.attn_implementation={requested}); use "
                              f"model.attn_implementation=sdpa, or data.packed_attention={AUTO}")
        return AttentionChoice(implementation, device_type=device_type)
    caps = caps or KernelCapabilities.probe(device_type)
    dropout = float(getattr(config, "attention_dropout", 0.0) or 0.0)
    kernel, passed = choose_packed_kernel(caps, packed_request, precision=precision, dropout=dropout)
    return AttentionChoice(implementation, kernel, device_type, passed)


def choose_attn_implementation(requested: str, config) -> Optional[str]:
    """The kernel to pass to ``from_pretrained`` outside training (chat, eval, merge); see :func:`choose_attention`."""
    return choose_attention(requested, config).implementation


#: The class flag that says whether a model class has each kernel.
_SUPPORT_FLAGS = {"sdpa": "_supports_sdpa", "flash_attention_2": "_supports_flash_attn",
                  "flash_attention_3": "_supports_flash_attn", "flex_attention": "_supports_flex_attn"}


def _implementation(requested: str, model_class) -> Optional[str]:
    if requested != AUTO:
        flag = _SUPPORT_FLAGS.get(requested)
        if model_class is not None and flag is not None and not getattr(model_class, flag, False):
            raise FtctlError(f"model.attn_implementation={requested}: {model_class.__name__} has no {requested} attention; "
                             f"use model.attn_implementation={AUTO} (it picks {_implementation(AUTO, model_class)})")
        return requested
    if model_class is None:
        return None  # transformers applies the same rule (sdpa when supported, else eager) to classes it finds itself
    return "sdpa" if getattr(model_class, "_supports_sdpa", False) else "eager"
