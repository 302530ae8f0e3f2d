"""Adapter methods: LoRA, and its variants DoRA (``use_dora``) and QLoRA (a 4-bit base).

They differ only in how the base is loaded and in one flag of the peft LoraConfig, so they share
this class; the quantised base of QLoRA comes from :mod:`ftctl.methods.quantization`.
"""

from __future__ import annotations

from typing import List, Union

import torch

from ftctl.methods.base import Method
from ftctl.models.loading import load_causal_lm


def lora_target_modules(names: List[str]) -> Union[str, List[str]]:
    return "all-linear" if list(names) == ["all-linear"] else list(names)


class AdapterMethod(Method):
    def __init__(self, cfg):
        super().__init__(cfg)
        self.name = cfg.method.name
        self.use_dora = cfg.method.use_dora or cfg.method.name == "dora"

    def load_base(self, model_path, precision, device):
        # Frozen base weights may sit in the compute dtype; LoRA weights are created fp32 below.
        base = load_causal_lm(self.cfg.model, model_path, dtype=precision.frozen_weight_dtype())
        return base.to(device)

    def build_model(self, model_path, precision, device):
        from peft import LoraConfig, get_peft_model

        m = self.cfg.method
        base = self.load_base(model_path, precision, device)
        base.requires_grad_(False)
        config = LoraConfig(
            r=m.r,
            lora_alpha=m.alpha,
            lora_dropout=m.dropout,
            target_modules=lora_target_modules(m.target_modules),
            use_dora=self.use_dora,
            use_rslora=m.use_rslora,
            modules_to_save=list(m.modules_to_save) or None,
            bias="none",
            task_type="CAUSAL_LM",
        )
        try:
            model = get_peft_model(base, config, autocast_adapter_dtype=True)
        except ValueError as exc:
            from ftctl.errors import FtctlError

            raise FtctlError(f"method.target_modules={list(m.target_modules)}: {exc}") from None
        for param in model.parameters():
            if param.requires_grad and param.dtype != torch.float32:
                param.data = param.data.float()
        return model

    def trainable_state_dict(self, model, full_state):
        from peft import get_peft_model_state_dict

        return get_peft_model_state_dict(model, state_dict=full_state)

    def save(self, model, tokenizer, out_dir, state_dict=None):
        model.save_pretrained(out_dir, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(out_dir)
