"""Which attention kernel a model loads with: ``model.attn_implementation=auto`` asks the model class.

Not every family has every kernel: Gemma2 and GPT-OSS, for example, have no SDPA path (soft-capped
or sink attention) and refuse to load with ``sdpa``. ``auto`` therefore reads the class's own
capability flags (``_supports_sdpa``, ``_supports_flash_attn``) rather than a list of model names:
SDPA where the class has it, else eager; on CUDA, a packed run takes flash-attention's varlen
kernel when the class supports it and flash-attn is installed (it reads the packed boundaries
itself). Every command that loads a model goes through :func:`choose_attn_implementation`, via
:func:`ftctl.models.loading.load_causal_lm`.
"""

from __future__ import annotations

import importlib.util
from typing import Optional

from ftctl.errors import FtctlError

AUTO = "auto"


def causal_lm_class(config):
    """The transformers class AutoModelForCausalLM builds for ``config``, or None (remote code, unknown type)."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING

    try:
        return MODEL_FOR_CAUSAL_LM_MAPPING[type(config)]
    except (KeyError, ValueError):
        return None


#: The class flag that says whether a model class has each kernel.
_SUPPORT_FLAGS = {"sdpa": "_supports_sdpa", "flash_attention_2": "_supports_flash_attn",
                  "flash_attention_3": "_supports_flash_attn", "flex_attention": "_supports_flex_attn"}


def choose_attn_implementation(requested: str, config, *, device_type: str = "cpu", packing: bool = False) -> Optional[str]:
    """The kernel to pass to ``from_pretrained``: ``requested`` unless it is ``auto``; None lets transformers pick.

    An explicit kernel the model class lacks is refused here, in one line, rather than by transformers' paragraph.
    """
    if requested != AUTO:
        model_class = causal_lm_class(config)
        flag = _SUPPORT_FLAGS.get(requested)
        if model_class is not None and flag is not None and not getattr(model_class, flag, False):
            picked = choose_attn_implementation(AUTO, config, device_type=device_type, packing=packing)
            raise FtctlError(f"model.attn_implementation={requested}: {model_class.__name__} has no {requested} attention; "
                             f"use model.attn_implementation={AUTO} (it picks {picked})")
        return requested
    model_class = causal_lm_class(config)
    if model_class is None:
        return None  # transformers applies the same rule (sdpa when supported, else eager) to classes it finds itself
    if (device_type == "cuda" and packing and getattr(model_class, "_supports_flash_attn", False)
            and importlib.util.find_spec("flash_attn") is not None):
        return "flash_attention_2"
    return "sdpa" if getattr(model_class, "_supports_sdpa", False) else "eager"
