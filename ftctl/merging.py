"""Merge a LoRA, DoRA or QLoRA adapter into its base and write a standalone transformers model dir.

The adapter is a run's ``final/`` or one of its ``checkpoints/step-N/`` dirs (both are peft
adapter dirs). The base comes from the adapter's ``adapter_config.json`` unless given. Before any
weight is loaded, the adapter's tensor shapes are checked against the base architecture, so a
wrong base is one clear error. The merge itself always runs in fp32 and is cast to the requested
dtype afterwards, so bf16/fp16 output rounds once, not at every addition.

A QLoRA adapter was trained against the 4-bit base, so by default it is merged into that base
dequantised to fp32 (rebuilt from the settings ``ftctl_adapter.json`` recorded); with
``dequantize=False`` it goes into the original full-precision weights instead. It is never merged
into 4-bit weights.

:func:`merge_adapter` and :func:`write_merged` are separate so other commands (export) can merge
on the way without writing a model dir first.
"""

from __future__ import annotations

import json
import logging
import os
import pickle
import re
import shutil
from pathlib import Path
from typing import Dict, List, Optional, Tuple

import torch

from ftctl.errors import FtctlError, refused_pickle
from ftctl.methods.adapters import read_adapter_info
from ftctl.paths import check_output_path, make_parent
from ftctl.progress import stages

log = logging.getLogger("ftctl")

MERGE_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}
_PEFT_PREFIX = "base_model.model."
_LORA_KEY = re.compile(r"^(?P<module>.+)\.(?P<part>lora_A|lora_B|lora_embedding_A|lora_embedding_B|lora_magnitude_vector)(\.weight)?$")


def read_adapter_config(adapter_dir: Path) -> dict:
    path = adapter_dir / "adapter_config.json"
    if path.is_file():
        return json.loads(path.read_text())
    if not adapter_dir.is_dir():
        raise FtctlError(f"adapter={adapter_dir}: no such directory")
    if (adapter_dir / "config.json").is_file():
        raise FtctlError(f"adapter={adapter_dir} holds a full model, not an adapter; it loads as it is, with nothing to merge")
    hint = ""
    if (adapter_dir / "final" / "adapter_config.json").is_file():
        hint = f" (a run dir? its adapter is {adapter_dir / 'final'})"
    raise FtctlError(f"adapter={adapter_dir} is not a peft adapter dir: it has no adapter_config.json{hint}")


def _resolve_base(adapter_dir: Path, adapter_config: dict, base: Optional[str], base_key: str = "base") -> str:
    from ftctl.models.loading import resolve_model_path

    if base:
        return resolve_model_path(base, key=base_key)
    recorded = adapter_config.get("base_model_name_or_path")
    if not recorded:
        raise FtctlError(f"{adapter_dir / 'adapter_config.json'} names no base model; pass base=DIR")
    try:
        return resolve_model_path(recorded)
    except FtctlError:
        raise FtctlError(
            f"the adapter's base model {recorded} (base_model_name_or_path in {adapter_dir / 'adapter_config.json'}) "
            f"is not available here; pass base=DIR with the model the adapter was trained on"
        ) from None


def adapter_tensor_shapes(adapter_dir: Path) -> Dict[str, Tuple[int, ...]]:
    """Shapes of the adapter's tensors, keyed by the base model's module path (peft's prefix removed)."""
    safetensors_file = adapter_dir / "adapter_model.safetensors"
    if safetensors_file.is_file():
        from safetensors import safe_open

        with safe_open(str(safetensors_file), framework="pt") as f:
            shapes = {key: tuple(f.get_slice(key).get_shape()) for key in f.keys()}
    elif (adapter_dir / "adapter_model.bin").is_file():
        try:
            state = torch.load(adapter_dir / "adapter_model.bin", map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as exc:
            raise refused_pickle(adapter_dir / "adapter_model.bin", exc) from None
        shapes = {key: tuple(value.shape) for key, value in state.items()}
    else:
        raise FtctlError(f"adapter={adapter_dir} has no adapter_model.safetensors (or .bin)")
    return {key.removeprefix(_PEFT_PREFIX): shape for key, shape in shapes.items()}


def _expected_shape(module: torch.nn.Module, part: str, shape: Tuple[int, ...], fan_in_fan_out: bool):
    """The shape ``part`` must have on ``module``, or None when peft's layer type is not one checked here."""
    rank = shape[0] if part in ("lora_A", "lora_embedding_A") else shape[-1]
    if isinstance(module, torch.nn.Embedding):
        dims = {"lora_embedding_A": (rank, module.num_embeddings), "lora_embedding_B": (module.embedding_dim, rank)}
        return dims.get(part)
    if hasattr(module, "in_features"):
        fan_in, fan_out = module.in_features, module.out_features
    elif getattr(module, "weight", None) is not None and module.weight.ndim == 2:
        fan_out, fan_in = module.weight.shape[::-1] if fan_in_fan_out else module.weight.shape
    else:
        return None
    return {"lora_A": (rank, fan_in), "lora_B": (fan_out, rank), "lora_magnitude_vector": (fan_out,)}.get(part)


def _parameter_wrapper_target(name: str) -> Tuple[str, int]:
    """(the base module, how many wrappers deep) for an adapted module path.

    peft adapts parameters (``target_parameters``: fused MoE experts, routers) with a ``ParamWrapper``
    around the module that holds them; a second adapted parameter of the same module wraps the first
    wrapper, so its keys read ``experts.base_layer.lora_A``. The ``base_layer`` steps name no module
    of the base.
    """
    stacked = 0
    while name.endswith(".base_layer"):
        name = name[: -len(".base_layer")]
        stacked += 1
    return name, stacked


def adapter_mismatches(base_model: torch.nn.Module, shapes: Dict[str, Tuple[int, ...]], fan_in_fan_out: bool = False) -> List[str]:
    """Every adapter tensor that has no place in ``base_model`` or a shape that does not fit there."""
    modules = dict(base_model.named_modules())
    params = dict(base_model.named_parameters(remove_duplicate=False))  # a tied head is a parameter of its own name too
    problems = []
    for key, shape in sorted(shapes.items()):
        match = _LORA_KEY.match(key)
        if match is None:  # a module trained in full (modules_to_save): same name and shape as the base's
            if key not in params:
                problems.append(f"{key} has no counterpart in the base")
            elif tuple(params[key].shape) != shape:
                problems.append(f"{key} is {list(shape)} in the adapter but {list(params[key].shape)} in the base")
            continue
        name, part = match.group("module"), match.group("part")
        name, stacked = _parameter_wrapper_target(name)
        if name not in modules:
            problems.append(f"adapted layer {name} does not exist in the base")
            continue
        if stacked:
            own = [p for p in modules[name].parameters(recurse=False) if p.ndim >= 2]
            if len(own) <= stacked:
                problems.append(f"adapted parameters of {name}: the adapter wraps {stacked + 1}, the base holds {len(own)}")
            continue  # a ParamWrapper's factor shapes depend on which parameter it wraps; peft checks them on load
        expected = _expected_shape(modules[name], part, shape, fan_in_fan_out)
        if expected is not None and tuple(expected) != shape:
            problems.append(f"{name}.{part} is {list(shape)} in the adapter but the base layer needs {list(expected)}")
    return problems


def _grown_to(model: torch.nn.Module, adapter_dir: Path) -> torch.nn.Module:
    """The base with as many embedding and output rows as the adapter trained (data.add_special_tokens added tokens)."""
    rows = (read_adapter_info(adapter_dir) or {}).get("vocab_rows")
    if rows and model.get_input_embeddings().weight.shape[0] < rows:
        model.resize_token_embeddings(rows, mean_resizing=False)  # the adapter's trained rows replace these
    return model


def _check_base_fits(adapter_dir: Path, adapter_config: dict, base_path: str, tokenizer) -> None:
    """Compare the adapter with the base's architecture on the meta device: no weights are read."""
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(base_path)
    except (OSError, ValueError) as exc:
        raise FtctlError(f"could not read the base model config from {base_path}: {str(exc).splitlines()[0]}") from None
    with torch.device("meta"):
        skeleton = _grown_to(AutoModelForCausalLM.from_config(config), adapter_dir)
    problems = adapter_mismatches(skeleton, adapter_tensor_shapes(adapter_dir), adapter_config.get("fan_in_fan_out", False))
    vocab_rows = skeleton.get_input_embeddings().weight.shape[0]
    if len(tokenizer) > vocab_rows:
        problems.append(f"the tokenizer has {len(tokenizer)} tokens but the base embeds only {vocab_rows}")
    if problems:
        shown = "; ".join(problems[:3]) + (f"; and {len(problems) - 3} more" if len(problems) > 3 else "")
        raise FtctlError(
            f"base {base_path} does not match the adapter {adapter_dir}: {shown}. "
            f"Pass base=DIR with the model the adapter was trained on"
        )


def _load_tokenizer(adapter_dir: Path, base_path: str):
    """The adapter's tokenizer (it carries the chat template the run trained with), else the base's."""
    from transformers import AutoTokenizer

    source = str(adapter_dir) if (adapter_dir / "tokenizer_config.json").is_file() else base_path
    try:
        return AutoTokenizer.from_pretrained(source)
    except (OSError, ValueError) as exc:
        raise FtctlError(f"could not load the tokenizer from {source}: {str(exc).splitlines()[0]}") from None


def _check_dtype(dtype: str) -> None:
    if dtype not in MERGE_DTYPES:
        raise FtctlError(f"dtype={dtype} is not one of {', '.join(MERGE_DTYPES)}")


def merge_adapter(adapter_dir, base: Optional[str] = None, dtype: str = "float32", *, dequantize: bool = True,
                  base_key: str = "base"):
    """Load base + adapter and fold the adapter into the base weights; returns (plain transformers model, tokenizer).

    ``base_key`` names the option that gave ``base`` in messages (merge's base=, chat's and eval's model=).
    """
    from ftctl.models.loading import load_causal_lm
    from ftctl.trained_run import trained_model_config

    _check_dtype(dtype)
    adapter_dir = Path(adapter_dir).expanduser().absolute()
    adapter_config = read_adapter_config(adapter_dir)
    if adapter_config.get("peft_type", "LORA") != "LORA":
        raise FtctlError(f"adapter={adapter_dir} is a {adapter_config['peft_type']} adapter; ftctl merges LoRA-family adapters")
    base_path = _resolve_base(adapter_dir, adapter_config, base, base_key)
    tokenizer = _load_tokenizer(adapter_dir, base_path)
    _check_base_fits(adapter_dir, adapter_config, base_path, tokenizer)

    quantization = (read_adapter_info(adapter_dir) or {}).get("quantization")
    model_cfg = trained_model_config(base_path, str(adapter_dir))
    with stages("merge adapter", ["load base", "load adapter", "merge"]) as stage:
        stage("load base")
        if quantization and dequantize:
            from ftctl.methods.quantization import QuantSettings, load_dequantized

            settings = QuantSettings.from_dict(quantization)
            log.info("merging into %s dequantised from %s 4-bit (the weights the adapter trained against)", base_path, settings.quant_type)
            base_model = load_dequantized(model_cfg, base_path, settings, torch.float32)
        else:
            log.info("merging into the full-precision weights of %s", base_path)
            base_model = load_causal_lm(model_cfg, base_path, dtype=torch.float32)

        from peft import PeftModel

        _grown_to(base_model, adapter_dir)
        try:
            stage("load adapter")
            peft_model = PeftModel.from_pretrained(base_model, str(adapter_dir))
            stage("merge")
            merged = peft_model.merge_and_unload(safe_merge=True)
        except (RuntimeError, ValueError, KeyError) as exc:
            raise FtctlError(f"could not merge {adapter_dir} into {base_path}: {str(exc).splitlines()[0]}") from None
        merged.to(MERGE_DTYPES[dtype])
    return merged, tokenizer


def check_output_dir(output: Path, overwrite: bool) -> None:
    if output.exists() and not output.is_dir():
        raise FtctlError(f"output={output} exists and is not a directory")
    if output.is_dir() and any(output.iterdir()) and not overwrite:
        raise FtctlError(f"output={output} is not empty; choose another dir or pass overwrite=true")
    check_output_path(output, "output", directory=True)


def refuse_output_over_inputs(output: Path, **inputs: Optional[str]) -> None:
    """``output=`` must not be, or contain, a dir the command reads: writing it would first delete that input."""
    output = output.resolve()
    for key, source in inputs.items():
        if not source or not Path(source).expanduser().exists():
            continue  # not given, or an alias or hub id: nothing on disk to destroy
        path = Path(source).expanduser().resolve()
        if output == path or output in path.parents:
            raise FtctlError(f"output={output} is {key}= or a dir holding it: writing it would delete what the command reads")


def write_merged(model: torch.nn.Module, tokenizer, output_dir, *, overwrite: bool = False, max_shard_size=None) -> Path:
    """Write weights (safetensors), config, generation config and tokenizer into ``output_dir``, all or nothing.

    Everything goes to a hidden dir next to ``output_dir`` that is renamed into place when complete,
    so a failure leaves no half-written model behind (and an overwritten one stays until then).
    ``max_shard_size`` (bytes or a string like "2GB") splits the weights into indexed shards.
    """
    output = Path(output_dir).expanduser().absolute()
    check_output_dir(output, overwrite)
    make_parent(output, "output")
    # Named by pid rather than made by mkdtemp, whose 0700 mode would become the output's.
    staging = output.with_name(f".{output.name}.partial-{os.getpid()}")
    replaced = None
    try:
        shutil.rmtree(staging, ignore_errors=True)
        staging.mkdir()
        extra = {"max_shard_size": max_shard_size} if max_shard_size else {}
        with stages(f"write {output.name}", ["weights", "tokenizer"]) as stage:
            stage("weights")
            model.save_pretrained(staging, safe_serialization=True, **extra)
            stage("tokenizer")
            tokenizer.save_pretrained(staging)
        if output.exists():
            replaced = output.with_name(f".{output.name}.old-{os.getpid()}")
            shutil.rmtree(replaced, ignore_errors=True)
            os.replace(output, replaced)
        os.replace(staging, output)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        if replaced is not None and not output.exists():
            os.replace(replaced, output)
        raise
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)
    return output


def merge(adapter_dir, output_dir, *, base: Optional[str] = None, dtype: str = "float32",
          overwrite: bool = False, dequantize: bool = True) -> Path:
    """``ftctl merge``: check the output first (cheap), merge, write."""
    output = Path(output_dir).expanduser().absolute()
    check_output_dir(output, overwrite)
    _check_dtype(dtype)
    recorded_base = read_adapter_config(Path(adapter_dir).expanduser()).get("base_model_name_or_path")
    refuse_output_over_inputs(output, adapter=str(adapter_dir), base=base or recorded_base)
    model, tokenizer = merge_adapter(adapter_dir, base, dtype, dequantize=dequantize)
    return write_merged(model, tokenizer, output, overwrite=overwrite)
