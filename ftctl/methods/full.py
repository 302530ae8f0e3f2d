"""Full fine-tuning: every weight trains and the result is a complete transformers model dir."""

from __future__ import annotations

import torch

from ftctl.errors import FtctlError
from ftctl.methods.base import Method
from ftctl.models.loading import load_causal_lm


class FullFineTuning(Method):
    name = "full"

    def build_model(self, model_path, precision, device):
        # Trained weights are fp32 master copies whatever the compute precision.
        model = load_causal_lm(self.cfg.model, model_path, dtype=torch.float32, attention=self.attention)
        self.grow_vocabulary(model)
        model.to(device)
        model.requires_grad_(True)
        return model

    def trainable_state_dict(self, model, full_state):
        return full_state

    def load_checkpoint_weights(self, model, ckpt_dir):
        from safetensors.torch import load_file

        state = {}
        for shard in sorted(ckpt_dir.glob("model*.safetensors")):
            state.update(load_file(shard))
        missing, unexpected = model.load_state_dict(state, strict=False)
        tied = {k for k in missing if model.config.tie_word_embeddings and k.endswith("lm_head.weight")}
        if unexpected or set(missing) - tied:
            raise FtctlError(f"{ckpt_dir} does not match the model: missing {sorted(set(missing) - tied)[:3]}, unexpected {unexpected[:3]}")

    def save(self, model, tokenizer, out_dir, state_dict=None):
        model.save_pretrained(out_dir, state_dict=state_dict, safe_serialization=True)
        tokenizer.save_pretrained(out_dir)
