"""Find a model (local dir, alias or hub id) and load it with its tokenizer."""

from __future__ import annotations

import pickle
import re
from pathlib import Path
from typing import Optional

from ftctl.config.schema import ModelConfig, RunConfig
from ftctl.errors import FtctlError
from ftctl.models.aliases import aliases, is_alias, resolve_alias

_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


def resolve_model_path(name_or_path: str, key: str = "model.name_or_path", *, check_hub: bool = True) -> str:
    """A local dir for aliases and paths; a hub id is passed through for transformers to fetch.

    ``key`` is what the user set, for the message when there is no such model. ``check_hub`` refuses a
    hub id that can load neither from the hub nor from the local cache.
    """
    if is_alias(name_or_path):
        return str(resolve_alias(name_or_path))
    path = Path(name_or_path).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise FtctlError(f"{key}={name_or_path}: {path} is not a model dir (no config.json)")
        return str(path.resolve())
    if _HUB_ID.match(name_or_path) and not name_or_path.startswith((".", "/", "~")):
        from ftctl.models.hub import ensure_hub_model_available

        if check_hub:
            ensure_hub_model_available(name_or_path, key)
        return name_or_path
    known = ", ".join(sorted(aliases()))
    raise FtctlError(f"{key}={name_or_path}: no such dir, alias or hub id (aliases: {known})")


def load_tokenizer(model_cfg: ModelConfig, model_path: str):
    from transformers import AutoTokenizer

    source = model_cfg.tokenizer or model_path
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            source, revision=model_cfg.revision, trust_remote_code=model_cfg.trust_remote_code
        )
    except (OSError, ValueError) as exc:
        raise FtctlError(f"could not load the tokenizer from {source}: {str(exc).splitlines()[0]}") from None
    if tokenizer.pad_token_id is None:
        # Padding is masked by length, never by id, so reusing EOS as pad cannot hide a trained EOS.
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def load_model_config(model_cfg: ModelConfig, model_path: str):
    """The model's transformers config (its config.json): what decides the attention before the weights load."""
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(model_path, revision=model_cfg.revision, trust_remote_code=model_cfg.trust_remote_code)
    except (OSError, ValueError) as exc:
        raise FtctlError(f"could not load the model from {model_path}: {str(exc).splitlines()[0]}") from None


def attention_for_run(cfg: RunConfig, model_path: str, device_type: str, precision: str):
    """The run's attention implementation and packed kernel, one decision (:mod:`ftctl.models.attention_choice`)."""
    from ftctl.models.attention_choice import choose_attention
    from ftctl.models.packed_attention import KernelCapabilities

    return choose_attention(cfg.model.attn_implementation, load_model_config(cfg.model, model_path),
                            packing=cfg.data.packing, packed_request=cfg.data.packed_attention,
                            caps=KernelCapabilities.probe(device_type), precision=precision)


def load_causal_lm(model_cfg: ModelConfig, model_path: str, *, dtype, quantization_config=None, device_map=None,
                   attention=None):
    """The model with ``model_cfg``'s settings; ``attention``: a training run's :func:`attention_for_run`."""
    from transformers import AutoModelForCausalLM

    from ftctl.models.attention_choice import choose_attn_implementation

    config = load_model_config(model_cfg, model_path)
    if attention is not None:
        kernel = attention.implementation
    else:
        kernel = choose_attn_implementation(model_cfg.attn_implementation, config)
    try:
        return AutoModelForCausalLM.from_pretrained(
            model_path,
            config=config,
            revision=model_cfg.revision,
            trust_remote_code=model_cfg.trust_remote_code,
            dtype=dtype,
            attn_implementation=kernel,
            quantization_config=quantization_config,
            device_map=device_map,
            use_safetensors=None,
        )
    except (OSError, ValueError) as exc:
        raise FtctlError(f"could not load the model from {model_path}: {str(exc).splitlines()[0]}") from None
    except pickle.UnpicklingError as exc:  # torch's safe loader met a pickle that would run code
        from ftctl.errors import refused_pickle

        pickles = sorted(p.name for p in Path(model_path).glob("*") if p.suffix in (".bin", ".pt", ".pth", ".ckpt", ".pkl"))
        raise refused_pickle(Path(model_path) / pickles[0] if len(pickles) == 1 else f"{model_path} ({', '.join(pickles)})", exc) from None


def model_config_dict(model_path: Optional[str]) -> dict:
    import json

    return json.loads((Path(model_path) / "config.json").read_text())
