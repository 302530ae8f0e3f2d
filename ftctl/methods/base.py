"""The interface every fine-tuning method implements."""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional

import torch

from ftctl.config.schema import RunConfig
from ftctl.precision.policy import PrecisionPolicy


class Method:
    """Builds the trainable model and saves what the method produces."""

    name = ""
    #: Tokens the run added to the tokenizer (data.add_special_tokens), which the model grows rows for and trains.
    new_token_ids: List[int] = []

    def __init__(self, cfg: RunConfig, attention=None):
        self.cfg = cfg
        # The run's attention choice (ftctl.models.loading.attention_for_run); None: the model_cfg's own, unpacked.
        self.attention = attention

    def build_model(self, model_path: str, precision: PrecisionPolicy, device: torch.device) -> torch.nn.Module:
        """Load the base and make it trainable the method's way: only the right parameters require grad."""
        raise NotImplementedError

    def grow_vocabulary(self, model: torch.nn.Module) -> None:
        """Give the added tokens embedding and output rows (initialised from the old rows' mean and covariance);
        the method makes them trainable. A model with spare rows already (padded vocabularies) keeps its size."""
        if not self.new_token_ids:
            return
        needed = max(self.new_token_ids) + 1
        if model.get_input_embeddings().weight.shape[0] < needed:
            model.resize_token_embeddings(needed, mean_resizing=True)
        self.vocab_rows = int(model.get_input_embeddings().weight.shape[0])

    def trainable_state_dict(self, model: torch.nn.Module, full_state: Dict[str, torch.Tensor]) -> Dict[str, torch.Tensor]:
        """The part of a (gathered) state dict that this method trains; what checkpoints must keep."""
        raise NotImplementedError

    def save(self, model: torch.nn.Module, tokenizer, out_dir: Path, state_dict: Optional[Dict[str, torch.Tensor]] = None) -> None:
        """Write the result as a directory the Hugging Face tools load directly (safetensors only)."""
        raise NotImplementedError

    def load_checkpoint_weights(self, model: torch.nn.Module, ckpt_dir: Path) -> None:
        """Load the weights a checkpoint written by :meth:`save` holds into a freshly built model."""
        raise NotImplementedError

    @staticmethod
    def count_parameters(model: torch.nn.Module) -> Dict[str, int]:
        trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        total = sum(_logical_numel(p) for p in model.parameters())
        return {"trainable": trainable, "total": total}


def _logical_numel(param: torch.Tensor) -> int:
    """Parameters a tensor stands for: a bitsandbytes 4-bit weight packs two into each byte it stores."""
    quant_state = getattr(param, "quant_state", None)
    return quant_state.shape.numel() if quant_state is not None else param.numel()
