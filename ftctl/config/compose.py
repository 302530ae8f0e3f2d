"""Compose a run's config from the recipe tree and command-line overrides, validate it, resolve it once.

The parent process does this; worker processes only read the resolved ``config.yaml``
(:func:`load_resolved`), so every rank trains on exactly the config the user saw.
"""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path
from typing import Dict, List, Optional, Sequence

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from ftctl.config.schema import DEFAULT_MAX_STEPS, RunConfig
from ftctl.config.validate import refuse_unknown_objective, refuse_unsupported_method, validate
from ftctl.errors import ConfigError, did_you_mean
from ftctl.paths import recipes_dir, samples_dir

GROUPS = ("model", "method", "parallel", "precision", "data", "objective", "recipe")
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
    "learning_rate": "train.lr", "lr_scheduler_type": "train.lr_scheduler",
    "batch_size": "train.micro_batch_size", "per_device_train_batch_size": "train.micro_batch_size",
    "gradient_accumulation_steps": "train.global_batch_size (accumulation = global ÷ (micro × world size))",
    "num_epochs": "train.epochs", "num_train_epochs": "train.epochs", "warmup_ratio": "train.warmup_ratio",
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
    # Common words and near-names that spelling alone would send to the wrong key (lr_rate is not min_lr_ratio).
    "lr_rate": "train.lr", "learningrate": "train.lr", "rate": "train.lr",
    "n_epochs": "train.epochs", "epoch": "train.epochs", "num_train_epoch": "train.epochs",
    "steps": "train.max_steps", "num_steps": "train.max_steps", "total_steps": "train.max_steps",
    "train_steps": "train.max_steps", "max_iters": "train.max_steps", "iterations": "train.max_steps",
    "num_warmup_steps": "train.warmup_steps", "warmup": "train.warmup_steps (or train.warmup_ratio)",
    "scheduler": "train.lr_scheduler", "lr_schedule": "train.lr_scheduler",
    "train_batch_size": "train.global_batch_size", "total_batch_size": "train.global_batch_size",
    "micro_batch": "train.micro_batch_size", "per_device_batch_size": "train.micro_batch_size",
    "grad_accum": "train.global_batch_size (accumulation = global ÷ (micro × world size))",
    "accumulation_steps": "train.global_batch_size (accumulation = global ÷ (micro × world size))",
    "gradient_accumulation": "train.global_batch_size (accumulation = global ÷ (micro × world size))",
    "target_modules": "method.target_modules",
    "max_length": "data.max_seq_len", "max_len": "data.max_seq_len", "seq_len": "data.max_seq_len",
    "seq_length": "data.max_seq_len", "context_length": "data.max_seq_len", "block_size": "data.max_seq_len",
    "wd": "train.weight_decay", "grad_clip": "train.max_grad_norm",
    "gradient_clipping": "train.max_grad_norm", "clip_grad_norm": "train.max_grad_norm", "max_norm": "train.max_grad_norm",
    "data_path": "data.path", "dataset_path": "data.path", "train_file": "data.path", "train_path": "data.path",
    "eval_file": "data.eval_path", "validation_file": "data.eval_path", "eval_dataset": "data.eval_path",
    "model": "model.name_or_path (or model=NAME for a preset)", "model_name": "model.name_or_path",
    "model_id": "model.name_or_path", "resume_from_checkpoint": "resume", "output": "output_dir",
    "output_path": "output_dir", "save_dir": "output_dir", "random_seed": "seed",
    "num_gpus": "parallel.nproc_per_node", "gpus": "parallel.nproc_per_node", "nproc": "parallel.nproc_per_node",
    "chat_template_name": "data.chat_template", "prompt_template": "data.chat_template",
    "rl": "objective=dpo, simpo, orpo or kto", "stage": "objective=sft, dpo, simpo, orpo or kto",
    "pref_loss": "objective=dpo objective.loss_type=... (or objective=simpo, orpo)", "pref_beta": "objective.beta",
    "dpo_beta": "objective.beta", "rl_beta": "objective.beta", "simpo_gamma": "objective.gamma",
    "cpo_alpha": "objective.sft_weight", "rpo_alpha": "objective.sft_weight", "pref_ftx": "objective.sft_weight",
    "orpo_alpha": "objective.orpo_lambda", "lambda": "objective.orpo_lambda", "dpo_label_smoothing": "objective.label_smoothing",
    "kto_desirable_weight": "objective.desirable_weight", "kto_undesirable_weight": "objective.undesirable_weight",
    "precompute_ref_log_probs": "objective.precompute_reference", "precompute_ref_logps": "objective.precompute_reference",
    "dpo_loss_type": "objective.loss_type",
    "dtype": "precision=fp32, bf16 or fp16", "torch_dtype": "precision=fp32, bf16 or fp16", "mixed_precision": "precision=bf16 or fp16",
    # The README's "Coming from axolotl, LLaMA-Factory or TRL" table, key for key.
    "lora_target_linear": "method.target_modules=[all-linear]", "train_on_inputs": "data.train_on_prompt",
    "val_size": "data.eval_fraction", "adapter": "method=lora or method=qlora (none: method=full)",
    "finetuning_type": "method=full, lora, qlora or dora", "quantization_bit": "method=qlora",
    "use_dora": "method=dora", "peft_use_dora": "method=dora", "lora_modules_to_save": "method.modules_to_save",
    "additional_target": "method.modules_to_save", "special_tokens": "data.add_special_tokens (a named template's markers)",
    "tokens": "data.add_special_tokens (a named template's markers)", "wandb_project": "train.report_to=[wandb] (project: WANDB_PROJECT)",
    "disable_gradient_checkpointing": "train.gradient_checkpointing", "assistant_only_loss": "data.train_on_prompt (false: the default)",
    "completion_only_loss": "data.train_on_prompt (false: the default)", "fsdp_config": "parallel=fsdp",
    "chat_template_path": "data.chat_template", "dataset_text_field": "data.format=text (records with a 'text' field)",
}


def under_mapping(key: str, fields) -> bool:
    """Whether ``key`` names an entry inside a mapping-typed key (data.eval_sets.orders), whose keys are free."""
    parts = key.split(".")
    return any(str(getattr(fields.get(".".join(parts[:i])), "type", "")).startswith("Dict[") for i in range(1, len(parts)))


def _unknown_key_hint(key: str, fields) -> str:
    name = key.rsplit(".", 1)[-1]
    placed = [k for k in fields if k.rsplit(".", 1)[-1] == name]
    meaning = OTHER_TOOLS_NAMES.get(name.lower().replace("-", "_"))
    if len(placed) == 1:  # an ftctl name in the wrong section, or without one (or another tool's: axolotl's adapter)
        return f" Did you mean '{placed[0]}'?" + (f" (Other tools' {name}: {meaning}.)" if meaning else "")
    if meaning:  # by meaning before spelling: lr_rate is train.lr, though it is spelled like min_lr_ratio
        return f" ftctl's name for it: {meaning}."
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
        if key == "method":
            refuse_unsupported_method(f"method={value}", value)
        if key == "objective":
            refuse_unknown_objective(f"objective={value}", value)
        options = group_options(key)
        if value not in options and not (key == "recipe" and value == "null"):
            listing = ", ".join(options)
            raise ConfigError(
                f"unknown {key} '{value}'.{did_you_mean(value, options)} Available: {listing}"
                + (" (see `ftctl recipes`)" if key == "recipe" else "")
            )
        return f"recipe@_global_={value}" if key == "recipe" else raw
    if key not in fields and not under_mapping(key, fields):
        raise ConfigError(f"unknown config key '{key}'.{_unknown_key_hint(key, fields)} (`ftctl config-docs` lists every key)")
    if key not in fields or str(fields[key].type).startswith("Dict["):
        return f"++{raw}"  # a mapping's keys are the user's (named eval sets), so Hydra's struct mode must let them in
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


#: Keys that say one thing two ways, with the value that unsets each: setting one on the command
#: line unsets the other, so `recipe=tiny_lora train.epochs=2` trains by epochs though the recipe sets max_steps.
ALTERNATIVE_KEYS = {
    "train.max_steps": ("train.epochs", "null"), "train.epochs": ("train.max_steps", "null"),
    "train.warmup_steps": ("train.warmup_ratio", "0"), "train.warmup_ratio": ("train.warmup_steps", "0"),
}


def _unset_alternatives(overrides: Sequence[str]) -> List[str]:
    values = dict(o.split("=", 1) for o in overrides if "=" in o)
    unsetting = {other: unset for other, unset in ALTERNATIVE_KEYS.values()}  # each key's own "not set"
    return [
        f"{other}={unset}" for key, (other, unset) in ALTERNATIVE_KEYS.items()
        if key in values and other not in values and values[key].strip().lower() not in (unsetting[key], unsetting[key] + ".0")
    ]


def compose_config(overrides: Sequence[str] = (), config_file: Optional[str] = None, *, needs_data: bool = True,
                   paths_from_file: bool = True) -> RunConfig:
    """Compose, check and resolve a run config; raises ConfigError with one readable message.

    ``config_file`` is a recipe file kept anywhere (``ftctl train --config FILE``), composed as a preset;
    the relative paths it names resolve against its directory unless ``paths_from_file`` is False (a run's
    own config.yaml, whose paths are the command line's). ``needs_data=False`` accepts a config without
    training data (``ftctl estimate`` reads none).
    """
    if config_file is None:
        return _finish(compose_unresolved(overrides), needs_data)
    path = Path(config_file).expanduser()
    try:
        return _finish(compose_unresolved(overrides, path, paths_from_file), needs_data)
    except ConfigError as exc:
        raise ConfigError(_located_in(path, str(exc), overrides)) from exc.__cause__


def compose_unresolved(overrides: Sequence[str] = (), config_file: Optional[Path] = None, paths_from_file: bool = True):
    """The composed config before interpolations resolve and before validation."""
    from hydra import compose, initialize_config_dir
    from hydra.core.global_hydra import GlobalHydra

    _register_once()
    fields = schema_fields()
    hydra_overrides = [_check_override(o, fields) for o in overrides]
    if config_file is not None:
        hydra_overrides = _with_config_file(config_file, overrides, hydra_overrides, fields, paths_from_file)
    hydra_overrides += _unset_alternatives(overrides)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(recipes_dir()), version_base=None):
            return compose(config_name="config", overrides=hydra_overrides)
    except ConfigError:
        raise
    except Exception as exc:  # Hydra and OmegaConf raise many types; all are the user's config
        raise ConfigError(_explain_hydra_error(exc)) from exc
    finally:
        GlobalHydra.instance().clear()


def _with_config_file(path: Path, overrides: Sequence[str], hydra_overrides: List[str], fields, paths_from_file: bool) -> List[str]:
    """The file as the recipe; the command line's group choices still win over the sections the file sets."""
    from hydra.core.config_store import ConfigStore

    from ftctl.config.config_file import CONFIG_FILE_RECIPE, group_choice_as_keys, load_config_file

    if not path.is_file():
        raise ConfigError(f"--config {path}: no such file")
    choices = [o.split("=", 1) for o in overrides if o.split("=", 1)[0] in GROUPS]
    if any(group == "recipe" for group, _ in choices):
        raise ConfigError(f"pass recipe=NAME or --config {path}, not both (the file is the recipe)")
    content = load_config_file(path, fields, _unknown_key_hint, group_options, lambda key: under_mapping(key, fields),
                               relative_paths=paths_from_file)
    ConfigStore.instance().store(group="recipe", name=CONFIG_FILE_RECIPE, node=content)
    as_keys = [key for group, option in choices for key in group_choice_as_keys(recipes_dir() / group / f"{option}.yaml", group)]
    groups = [o for o in hydra_overrides if o.split("=", 1)[0] in GROUPS]
    keys = [o for o in hydra_overrides if o.split("=", 1)[0] not in GROUPS]
    return [f"recipe@_global_={CONFIG_FILE_RECIPE}", *groups, *as_keys, *keys]


def _located_in(path: Path, message: str, overrides: Sequence[str]) -> str:
    """Prefix FILE:LINE when the message is about a key the file sets (and the command line does not)."""
    from ftctl.config.config_file import line_of

    if str(path) in message:
        return message
    on_command_line = {o.split("=", 1)[0] for o in overrides}
    for key in re.findall(r"[A-Za-z_]+(?:\.[A-Za-z_]+)+|\b(?:output_dir|seed|resume|overwrite)\b", message):
        line = line_of(path, key)
        if line and key not in on_command_line:
            return f"{path}:{line}: {message}"
    return f"{path}: {message}"


def no_model_message() -> str:
    """What a run without a model is told: ftctl picks none for it (a random tiny model would train silently)."""
    from ftctl.models.aliases import aliases

    return (f"no model: set model.name_or_path=DIR_OR_HUB_ID or an alias ({', '.join(sorted(aliases()))}; "
            f"`ftctl models` describes them), or model=PRESET ({', '.join(group_options('model'))}), or recipe=NAME (`ftctl recipes`)")


def _finish(cfg, needs_data: bool = True) -> RunConfig:
    missing = sorted(OmegaConf.missing_keys(cfg))
    if "model.name_or_path" in missing:
        raise ConfigError(no_model_message())
    if missing:
        raise ConfigError(f"config key '{missing[0]}' has no value; set it, for example {missing[0]}=...")
    try:
        run = OmegaConf.to_object(cfg)
    except OmegaConfBaseException as exc:
        raise ConfigError(f"config key '{getattr(exc, 'full_key', '')}': {str(exc).splitlines()[0]}") from exc
    validate(run, needs_data)
    if run.train.max_steps is None and run.train.epochs is None:
        run.train.max_steps = DEFAULT_MAX_STEPS  # written out, so config.yaml says how long the run is
    return run


def recipe_yaml(name: str) -> str:
    """A preset as one full config file to edit and train with --config: every key, its run dir still timestamped."""
    run = _finish(compose_unresolved([f"recipe={name}"]))
    run.output_dir = schema_fields()["output_dir"].default  # a new timestamped dir per run, not the one of today
    return (f"# ftctl recipe {name}, every key set (ftctl config-docs explains each).\n"
            f"# Train it with: ftctl train --config FILE [key=value ...]\n" + to_yaml(run))


def to_yaml(run: RunConfig) -> str:
    return OmegaConf.to_yaml(OmegaConf.structured(run))


def load_resolved(path: str | Path) -> RunConfig:
    """Read a config.yaml written by :func:`to_yaml` (a run dir's), re-checking it against the schema."""
    from ftctl.config.config_file import compose_yaml

    _register_once()
    compose_yaml(Path(path))  # UTF-8 and plain values, or one line naming file:line
    try:
        cfg = OmegaConf.merge(OmegaConf.structured(RunConfig), OmegaConf.load(path))
    except OmegaConfBaseException as exc:
        raise ConfigError(f"{path}: {str(exc).splitlines()[0]}") from exc
    return _finish(cfg)
