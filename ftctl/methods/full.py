"""Full fine-tuning: every weight trains and the result is a complete transformers model dir."""

from __future__ import annotations

import torch

from ftctl.methods.base import Method
from ftctl.models.loading import load_causal_lm


class FullFineTuning(Method):
    name = "full"

    def build_model(self, model_path, precision, device):
        # Trained weights are fp32 master copies whatever the compute precision.
        model = load_causal_lm(self.cfg.model, model_path, dtype=torch.float32)
        model.to(device)
        model.requires_grad_(True)
        return model

    def trainable_state_dict(self, model, full_state):
        return full_state

    def save(self, model, tokenizer, out_dir, state_dict=None):
        model.save_pretrained(out_dir, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(out_dir)
