"""Compose a run's config from the recipe tree and command-line overrides, validate it, resolve it once.

The parent process does this; worker processes only read the resolved ``config.yaml``
(:func:`load_resolved`), so every rank trains on exactly the config the user saw.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Dict, List, Sequence

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ftctl.config.schema import RunConfig
from ftctl.config.validate import validate
from ftctl.errors import ConfigError, did_you_mean
from ftctl.paths import recipes_dir, samples_dir

GROUPS = ("model", "method", "parallel", "precision", "data", "recipe")
_SCHEMA_NAME = "ftctl_schema"
_OVERRIDE = re.compile(r"^(?P<prefix>\+{0,2}|~)(?P<key>[A-Za-z_][\w.@/-]*)(=(?P<value>.*))?$", re.S)


def _register_once() -> None:
    from hydra.core.config_store import ConfigStore

    if not OmegaConf.has_resolver("ftctl_sample"):
        OmegaConf.register_new_resolver("ftctl_sample", lambda name: str(samples_dir() / name))
    ConfigStore.instance().store(name=_SCHEMA_NAME, node=RunConfig)


def schema_fields() -> Dict[str, dataclasses.Field]:
    """Every settable dotted key of the schema, with its dataclass field."""
    out: Dict[str, dataclasses.Field] = {}

    def walk(cls, prefix: str) -> None:
        for f in dataclasses.fields(cls):
            key = prefix + f.name
            if dataclasses.is_dataclass(f.type) or (isinstance(f.type, str) and f.type.endswith("Config")):
                walk(_section_class(cls, f), key + ".")
            else:
                out[key] = f

    walk(RunConfig, "")
    return out


def _section_class(cls, f: dataclasses.Field):
    return f.default_factory if f.default_factory is not dataclasses.MISSING else type(f.default)


def group_options(group: str) -> List[str]:
    folder = recipes_dir() / group
    return sorted(p.stem for p in folder.glob("*.yaml"))


def list_recipes() -> List[Dict[str, str]]:
    """Presets with their command line and one-line description, read from each file's header comment."""
    recipes = []
    for name in group_options("recipe"):
        comments = []
        for line in (recipes_dir() / "recipe" / f"{name}.yaml").read_text().splitlines():
            if not line.startswith("#"):
                break
            comments.append(line.lstrip("#").strip())
        command = next((c for c in comments if c.startswith("ftctl ")), f"ftctl train recipe={name}")
        description = next((c for c in comments if not c.startswith("ftctl ") and c), "")
        recipes.append({"name": name, "command": command, "description": description})
    return recipes


_PLAIN_NAMES = re.compile(r"^(?!null$)[\w.\-*/]+(,[\w.\-*/]+)*$")

#: Names other fine-tuning tools (transformers' TrainingArguments, axolotl, LLaMA-Factory, TRL) give
#: to ftctl settings: an unknown key whose last part is one of these is pointed at ftctl's spelling.
OTHER_TOOLS_NAMES = {
    "learning_rate": "train.lr", "lr_scheduler_type": "train.min_lr_ratio (cosine decay to it)",
    "batch_size": "train.micro_batch_size", "per_device_train_batch_size": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.global_batch_size (accumulation = global ÷ (micro × world size))",
    "num_epochs": "train.max_steps", "num_train_epochs": "train.max_steps", "warmup_ratio": "train.warmup_steps",
    "logging_steps": "train.log_every", "save_steps": "train.save_every", "eval_steps": "train.eval_every",
    "save_total_limit": "train.keep_last", "optim": "train.optimizer",
    "lora_r": "method.r", "lora_rank": "method.r", "lora_alpha": "method.alpha", "lora_dropout": "method.dropout",
    "lora_target_modules": "method.target_modules", "lora_target": "method.target_modules",
    "sequence_len": "data.max_seq_len", "max_seq_length": "data.max_seq_len", "cutoff_len": "data.max_seq_len",
    "sample_packing": "data.packing", "val_set_size": "data.eval_fraction", "datasets": "data.path",
    "dataset": "data.path", "template": "data.chat_template",
    "base_model": "model.name_or_path", "model_name_or_path": "model.name_or_path",
    "bf16": "precision=bf16", "fp16": "precision=fp16", "load_in_4bit": "method=qlora",
    "deepspeed": "parallel=zero1, zero2 or zero3", "fsdp": "parallel=fsdp",
}


def _unknown_key_hint(key: str, fields) -> str:
    name = key.rsplit(".", 1)[-1]
    placed = [k for k in fields if k.rsplit(".", 1)[-1] == name]
    if len(placed) == 1:  # an ftctl name in the wrong section, or without one
        return f" Did you mean '{placed[0]}'?"
    if name in OTHER_TOOLS_NAMES:
        return f" ftctl's name for it: {OTHER_TOOLS_NAMES[name]}."
    section = key.split(".")[0]
    same_section = [k for k in fields if k.startswith(section + ".")]
    hint = did_you_mean(key, same_section or fields)
    if not hint and section in GROUPS and "." not in key:
        hint = f" '{section}' is a group; choose one of: {', '.join(group_options(section))}"
    return hint


def _check_override(raw: str, fields: Dict[str, dataclasses.Field]) -> str:
    """Check one `key=value` against the schema and the recipe tree; return it in Hydra's spelling."""
    match = _OVERRIDE.match(raw)
    if not match or match.group("value") is None:
        raise ConfigError(f"cannot read override '{raw}': write key=value, for example train.lr=1e-4")
    prefix, key, value = match.group("prefix"), match.group("key"), match.group("value")
    if prefix:
        raise ConfigError(
            f"override '{raw}': ftctl's schema is closed, so '{prefix}' adds or removes nothing; "
            f"set an existing key with {key}=VALUE"
        )
    if key in GROUPS:
        options = group_options(key)
        if value not in options and not (key == "recipe" and value == "null"):
            listing = ", ".join(options)
            raise ConfigError(
                f"unknown {key} '{value}'.{did_you_mean(value, options)} Available: {listing}"
                + (" (see `ftctl recipes`)" if key == "recipe" else "")
            )
        return f"recipe@_global_={value}" if key == "recipe" else raw
    if key not in fields:
        raise ConfigError(f"unknown config key '{key}'.{_unknown_key_hint(key, fields)} (`ftctl config-docs` lists every key)")
    if str(fields[key].type).startswith("List[") and _PLAIN_NAMES.match(value):
        return f"{key}=[{value}]"  # one name, or a comma-separated list, means the list of them
    return raw


def _explain_hydra_error(exc: Exception) -> str:
    cause = exc.__cause__ or exc.__context__
    if isinstance(cause, OmegaConfBaseException):
        full_key = getattr(cause, "full_key", None) or ""
        msg = str(cause).split("\n")[0]
        if "could not be converted" in msg or "Value '" in msg:
            expected = re.search(r"converted to (\w+)", msg)
            got = re.search(r"Value '(.*?)' of type", msg)
            what = f"expected {expected.group(1).lower()}" if expected else msg
            return f"config key '{full_key}': {what}, got '{got.group(1) if got else '?'}'"
        if "not in" in msg or "Key '" in msg:
            bad = re.search(r"Key '(\w+)'", msg)
            fields = schema_fields()
            key = full_key or (bad.group(1) if bad else "?")
            return f"unknown config key '{key}'.{did_you_mean(key, fields)}"
        return f"config key '{full_key}': {msg}"
    text = str(exc).strip().replace("\n", " ")
    where = re.search(r"In '([\w/]+)'", text)
    if where and "not in" in text:
        return f"recipes/{where.group(1)}.yaml: {text}"
    return text


def compose_config(overrides: Sequence[str] = ()) -> RunConfig:
    """Compose, check and resolve a run config; raises ConfigError with one readable message."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    _register_once()
    fields = schema_fields()
    hydra_overrides = [_check_override(o, fields) for o in overrides]
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(recipes_dir()), version_base=None):
            cfg = compose(config_name="config", overrides=hydra_overrides)
    except ConfigError:
        raise
    except Exception as exc:  # Hydra and OmegaConf raise many types; all are the user's config
        raise ConfigError(_explain_hydra_error(exc)) from exc
    finally:
        GlobalHydra.instance().clear()
    return _finish(cfg)


def _finish(cfg) -> RunConfig:
    missing = sorted(OmegaConf.missing_keys(cfg))
    if missing:
        raise ConfigError(f"config key '{missing[0]}' has no value; set it, for example {missing[0]}=...")
    try:
        run = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"config key '{getattr(exc, 'full_key', '')}': {str(exc).splitlines()[0]}") from exc
    validate(run)
    return run


def to_yaml(run: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(run))


def load_resolved(path: str | Path) -> RunConfig:
    """Read a config.yaml written by :func:`to_yaml` (a run dir's), re-checking it against the schema."""
    _register_once()
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(RunConfig), OmegaConf.load(path))
    except OmegaConfBaseException as exc:
        raise ConfigError(f"{path}: {str(exc).splitlines()[0]}") from exc
    return _finish(cfg)
