"""Adapter methods: LoRA, and its variants DoRA (``use_dora``) and QLoRA (a 4-bit base).

They differ only in how the base is loaded and in one flag of the peft LoraConfig, so LoRA and
DoRA share :class:`AdapterMethod` and QLoRA only swaps its base loader
(:class:`QuantizedAdapterMethod`, with the quantisation in :mod:`ftctl.methods.quantization`).
Every saved adapter dir also holds ``ftctl_adapter.json``, which tells ``ftctl merge`` how the
base was loaded (for QLoRA, the exact quantisation settings).
"""

from __future__ import annotations

import json
import logging
import re
import warnings
from pathlib import Path
from typing import List, Optional, Union

import torch

from ftctl.methods.base import Method
from ftctl.methods.dropout import use_bits_dropout
from ftctl.methods.fused_lora import use_fused_lora_forward
from ftctl.models.loading import load_causal_lm

log = logging.getLogger("ftctl")

ADAPTER_INFO_FILE = "ftctl_adapter.json"


def lora_target_modules(names: List[str]) -> Union[str, List[str]]:
    return "all-linear" if list(names) == ["all-linear"] else list(names)


def unadaptable_by_dora(model: torch.nn.Module) -> List[str]:
    """Weight parameters outside linear layers (fused MoE experts, routers), which peft adapts only through
    ``ParamWrapper``, and peft's DoRA has no ``ParamWrapper``. Named once per layer pattern (``layers.N`` → ``layers.*``)."""
    from transformers.pytorch_utils import Conv1D

    layer_kinds = (torch.nn.Linear, torch.nn.Embedding, Conv1D)
    head = model.get_output_embeddings()
    names = set()
    for module_name, module in model.named_modules():
        if isinstance(module, layer_kinds) or module is head:
            continue
        for param_name, param in module.named_parameters(recurse=False):
            if param.ndim >= 2:
                names.add(re.sub(r"\.\d+\.", ".*.", f"{module_name}.{param_name}"))
    return sorted(names)


def linear_layer_names(model: torch.nn.Module) -> List[str]:
    """Every linear layer but the output head, as full module paths: what peft's all-linear finds."""
    from transformers.pytorch_utils import Conv1D

    head = model.get_output_embeddings()
    return sorted(name for name, module in model.named_modules()
                  if isinstance(module, (torch.nn.Linear, Conv1D)) and module is not head)


def _tied(model: torch.nn.Module) -> bool:
    head = model.get_output_embeddings()
    return head is not None and head.weight is model.get_input_embeddings().weight
def adapter_dir_of(value: str, key: str = "model.adapter") -> Path:
    """The peft adapter dir that ``value`` names: the dir itself, or a run dir's final/."""
    from ftctl.errors import FtctlError

    path = Path(value).expanduser()
    for candidate in (path, path / "final"):
        if (candidate / "adapter_config.json").is_file():
            return candidate
    raise FtctlError(f"{key}={value}: no adapter_config.json there or in its final/; pass a LoRA, DoRA or QLoRA result dir")


def read_adapter_info(adapter_dir: Path) -> Optional[dict]:
    """What :meth:`AdapterMethod.save` recorded about the base, or None for adapters made elsewhere."""
    path = Path(adapter_dir) / ADAPTER_INFO_FILE
    return json.loads(path.read_text()) if path.is_file() else None


class AdapterMethod(Method):
    def __init__(self, cfg, attention=None):
        super().__init__(cfg, attention)
        self.name = cfg.method.name
        self.use_dora = cfg.method.use_dora or cfg.method.name == "dora"

    def load_base(self, model_path, precision, device):
        # Frozen base weights may sit in the compute dtype; LoRA weights are created fp32 below.
        base = load_causal_lm(self.cfg.model, model_path, dtype=precision.frozen_weight_dtype(), attention=self.attention)
        return base.to(device)

    def base_info(self) -> dict:
        """How the base was loaded, as far as a merge needs to know."""
        return {"quantization": None}

    def build_model(self, model_path, precision, device):
        from peft import LoraConfig, get_peft_model

        m = self.cfg.method
        base = self.load_base(model_path, precision, device)
        self.grow_vocabulary(base)
        base.requires_grad_(False)
        if self.cfg.model.adapter:
            return self._prepared(self._existing_adapter(base, device))
        targets = lora_target_modules(m.target_modules)
        left_out = unadaptable_by_dora(base) if self.use_dora and targets == "all-linear" else []
        if left_out:
            # all-linear would make peft wrap the fused expert parameters too, which its DoRA refuses.
            targets = linear_layer_names(base)
            log.warning("method=%s: DoRA adapts the linear layers only; left out (no DoRA for fused MoE weights, "
                        "method=lora adapts them): %s", self.name, ", ".join(left_out))
        config = LoraConfig(
            r=m.r,
            lora_alpha=m.alpha,
            lora_dropout=m.dropout,
            target_modules=targets,
            use_dora=self.use_dora,
            use_rslora=m.use_rslora,
            modules_to_save=list(m.modules_to_save) + self._vocabulary_modules(base) or None,
            # Tied embeddings stay tied when both sides are trained in full (modules_to_save).
            ensure_weight_tying=bool(self.new_token_ids) and _tied(base),
            bias="none",
            task_type="CAUSAL_LM",
        )
        try:
            with warnings.catch_warnings():
                # peft's own transformers-5 MoE conversion sets these patterns; the user set none and can change nothing.
                warnings.filterwarnings("ignore", message=r"The following (rank|alpha)_pattern keys did not match",
                                        category=RuntimeWarning)
                model = get_peft_model(base, config, autocast_adapter_dtype=True)
        except ValueError as exc:
            from ftctl.errors import FtctlError

            if self.use_dora and "ParamWrapper" in str(exc):
                raise FtctlError(
                    f"method.target_modules={list(m.target_modules)} reaches fused MoE expert parameters, which DoRA "
                    f"cannot adapt; name linear layers only (e.g. [q_proj,k_proj,v_proj,o_proj]) or use method=lora"
                ) from None
            raise FtctlError(f"method.target_modules={list(m.target_modules)}: {exc}") from None
        return self._prepared(model)

    def _existing_adapter(self, base, device):
        """model.adapter: a trained adapter loaded to go on training (its own rank and targets)."""
        from peft import PeftModel

        from ftctl.errors import FtctlError

        adapter_dir = adapter_dir_of(self.cfg.model.adapter)
        config = json.loads((adapter_dir / "adapter_config.json").read_text())
        if bool(config.get("use_dora")) != self.use_dora:
            raise FtctlError(f"model.adapter={self.cfg.model.adapter} is a {'DoRA' if config.get('use_dora') else 'LoRA'} "
                             f"adapter; train it with method={'dora' if config.get('use_dora') else 'lora'} (or qlora)")
        try:
            return PeftModel.from_pretrained(base, str(adapter_dir), is_trainable=True).to(device)
        except (ValueError, RuntimeError, KeyError) as exc:
            raise FtctlError(f"model.adapter={self.cfg.model.adapter} does not fit {self.cfg.model.name_or_path}: "
                             f"{str(exc).splitlines()[0]}") from None

    @staticmethod
    def _prepared(model):
        for param in model.parameters():
            if param.requires_grad and param.dtype != torch.float32:
                param.data = param.data.float()
        use_bits_dropout(model)  # same dropout, without torch's slow per-element CPU random numbers
        use_fused_lora_forward(model)  # same function, fewer passes over full-width activations
        return model

    def _vocabulary_modules(self, base) -> List[str]:
        """The embedding and output head, trained in full when data.add_special_tokens added rows to them."""
        if not self.new_token_ids:
            return []
        names = {module: name for name, module in base.named_modules()}
        return [names[module] for module in (base.get_input_embeddings(), base.get_output_embeddings())
                if module is not None and names[module] not in self.cfg.method.modules_to_save]

    def trainable_state_dict(self, model, full_state):
        # Kept in the model's own key names: peft's save_pretrained picks and renames the adapter's
        # entries itself, and resolves modules_to_save only from those names.
        # Every name of a tied weight: peft saves the head's modules_to_save copy under its own name too.
        trained = [name for name, param in model.named_parameters(remove_duplicate=False) if param.requires_grad]
        missing = [name for name in trained if name not in full_state]
        if missing:
            raise RuntimeError(f"the gathered state dict lacks trained weights, e.g. {missing[:3]}")
        return {name: full_state[name] for name in trained}

    def load_checkpoint_weights(self, model, ckpt_dir):
        from peft import set_peft_model_state_dict
        from safetensors.torch import load_file

        result = set_peft_model_state_dict(model, load_file(ckpt_dir / "adapter_model.safetensors"))
        if getattr(result, "unexpected_keys", None):
            from ftctl.errors import FtctlError

            raise FtctlError(f"{ckpt_dir} holds adapter weights this model lacks: {result.unexpected_keys[:3]}")

    def save(self, model, tokenizer, out_dir, state_dict=None):
        # Grown embeddings are saved as modules_to_save; peft would otherwise add the whole layers a second time.
        model.save_pretrained(out_dir, state_dict=state_dict, safe_serialization=True, save_embedding_layers=False)
        tokenizer.save_pretrained(out_dir)
        info = {"method": self.name, "use_dora": self.use_dora, **self.base_info()}
        if self.new_token_ids:  # a merge grows the base to this many rows before the adapter loads
            info["vocab_rows"] = self.vocab_rows
        (Path(out_dir) / ADAPTER_INFO_FILE).write_text(json.dumps(info, indent=2) + "\n")


class QuantizedAdapterMethod(AdapterMethod):
    """QLoRA (and QDoRA with ``use_dora``): the same adapters over a base quantised to 4 bits."""

    settings = None

    def load_base(self, model_path, precision, device):
        from ftctl.methods.quantization import QuantSettings, load_4bit, prepare_for_kbit_training

        self.settings = QuantSettings.from_method(self.cfg.method, precision.compute_dtype)
        base = load_4bit(self.cfg.model, model_path, self.settings, device, attention=self.attention)
        return prepare_for_kbit_training(base, self.cfg.train.gradient_checkpointing)

    def base_info(self):
        return {"quantization": self.settings.to_dict()}
