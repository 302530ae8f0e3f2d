"""A recipe file the user keeps anywhere (`ftctl train --config my.yaml`), read with the line of every key.

The file is a recipe: the same keys, an optional Hydra ``defaults`` list of group choices, composed
and validated exactly as a preset in recipes/recipe/ is. Mistakes are reported as ``FILE:LINE``.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Dict, List, Optional

import yaml

from ftctl.errors import ConfigError

#: The name the file is registered under in the recipe group, so Hydra composes it as a preset.
CONFIG_FILE_RECIPE = "_config_file"


#: Tags that plain YAML values resolve to; any other (``!!python/object``, ``!custom``) would ask for an object.
PLAIN_TAGS = {f"tag:yaml.org,2002:{name}" for name in ("str", "int", "float", "bool", "null", "seq", "map", "timestamp")}


def compose_yaml(path: Path):
    """The file's YAML node tree: its bytes UTF-8 and its values plain, or one error naming file:line."""
    from ftctl.text_files import read_utf8

    from ftctl.errors import FtctlError

    try:
        root = yaml.compose(read_utf8(path))
    except FtctlError as exc:  # bytes that are not UTF-8: a config mistake like any other
        raise ConfigError(str(exc)) from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise ConfigError(f"{where}: not valid YAML: {getattr(exc, 'problem', None) or exc}") from None
    except OSError as exc:
        raise ConfigError(f"--config {path}: {exc.strerror}") from None
    stack = [root] if root is not None else []
    while stack:
        node = stack.pop()
        if node.tag not in PLAIN_TAGS:
            raise ConfigError(f"{path}:{node.start_mark.line + 1}: the YAML tag {node.tag.replace('tag:yaml.org,2002:', '!!')} "
                              "is not allowed: a config holds plain values, never objects; remove the tag")
        if isinstance(node, yaml.MappingNode):
            stack += [part for pair in node.value for part in pair]
        elif isinstance(node, yaml.SequenceNode):
            stack += node.value
    return root


def key_lines(path: Path) -> Dict[str, int]:
    """Each dotted key the file sets, with its 1-based line ("defaults" is Hydra's, not a key)."""
    root = compose_yaml(path)
    if root is None:
        return {}
    if not isinstance(root, yaml.MappingNode):
        raise ConfigError(f"{path}:{root.start_mark.line + 1}: a config file is a mapping of keys (model:, method:, train:, ...)")
    lines: Dict[str, int] = {}

    def walk(node: yaml.MappingNode, prefix: str) -> None:
        for key_node, value in node.value:
            key = f"{prefix}{key_node.value}"
            if key == "defaults":
                continue
            lines[key] = key_node.start_mark.line + 1
            if isinstance(value, yaml.MappingNode):
                walk(value, key + ".")

    walk(root, "")
    return lines


def load_config_file(path: Path, fields, unknown_key_hint, group_options, free_key=lambda key: False, *,
                     relative_paths: bool = True):
    """The file's content, after refusing keys the schema does not have (with the file's line; ``free_key``
    tells the entries of mapping-typed keys, data.eval_sets.NAME, which the user names), its defaults
    list in Hydra's spelling for a recipe, and (``relative_paths``) the paths it names that a run reads
    resolved against the file's directory."""
    from omegaconf import OmegaConf

    lines = key_lines(path)
    sections = {key.rsplit(".", 1)[0] for key in fields if "." in key}
    for key, line in lines.items():
        if key not in fields and key not in sections and not free_key(key):
            raise ConfigError(f"{path}:{line}: unknown config key '{key}'.{unknown_key_hint(key, fields)} "
                              "(`ftctl config-docs` lists every key)")
    content = OmegaConf.load(path)
    if "defaults" in content:
        content.defaults = group_choices(path, group_options)
    if relative_paths:
        resolve_paths_against(content, path.parent)
    return content


#: The groups a config file's defaults list may choose from; `recipe` is not one (the file is the recipe).
CONFIG_GROUPS = ("model", "method", "parallel", "precision", "data")


def group_choices(path: Path, group_options) -> list:
    """The file's ``defaults`` list as a recipe's overrides of the root's choices.

    Both spellings work: ``- method: dora`` (what users write) and Hydra's ``- override /method: dora``
    (a recipe's own), as do ``/method: dora`` and ``override method: dora``; ``_self_`` stays where it is.
    """
    node = next((value for key, value in yaml.compose(path.read_text()).value if key.value == "defaults"), None)
    if not isinstance(node, yaml.SequenceNode):
        where = f"{path}:{node.start_mark.line + 1}" if node is not None else str(path)
        raise ConfigError(f"{where}: defaults is a list of group choices, for example defaults: [{{method: dora}}]")
    out: list = []
    for entry in node.value:
        where = f"{path}:{entry.start_mark.line + 1}"
        if isinstance(entry, yaml.ScalarNode) and entry.value == "_self_":
            out.append("_self_")
            continue
        if not (isinstance(entry, yaml.MappingNode) and len(entry.value) == 1 and isinstance(entry.value[0][1], yaml.ScalarNode)):
            raise ConfigError(f"{where}: a defaults entry is one group choice such as '- method: dora' "
                              f"(groups: {', '.join(CONFIG_GROUPS)}), or _self_")
        key, option = entry.value[0][0].value, entry.value[0][1].value
        group = key.removeprefix("override").strip().lstrip("/")
        if group == "recipe":
            raise ConfigError(f"{where}: a config file cannot choose a recipe (the file is one); start from a preset "
                              "with `ftctl recipes cp NAME FILE` and edit that")
        if group not in CONFIG_GROUPS:
            from ftctl.errors import did_you_mean

            raise ConfigError(f"{where}: '{key}' is not a config group.{did_you_mean(group, CONFIG_GROUPS)} "
                              f"Groups: {', '.join(CONFIG_GROUPS)}")
        options = group_options(group)
        if option not in options:
            from ftctl.errors import did_you_mean

            raise ConfigError(f"{where}: unknown {group} '{option}'.{did_you_mean(str(option), options)} Available: {', '.join(options)}")
        out.append({f"override /{group}": option})
    return out


def resolve_paths_against(content, base: Path) -> None:
    """Paths a run reads, written relative, made relative to ``base`` (the config file's directory).

    A value is a path when it names something that exists there, starts with ./ or ../, or (data
    sources, templates) ends the way such a file does. Hub ids, aliases, template names, Jinja text,
    shipped architecture names, absolute paths and ${...} interpolations stay as written. What a run
    writes (output_dir, data.cache_dir) stays relative to the current directory, as on the command line.
    """
    data, model = content.get("data") or {}, content.get("model") or {}
    targets = [(model, "name_or_path", ()), (model, "tokenizer", ()), (model, "config_file", ()),
               (data, "path", DATA_SUFFIXES), (data, "eval_path", DATA_SUFFIXES), (data, "chat_template", (".jinja", ".j2"))]
    targets += [(source, "path", DATA_SUFFIXES) for source in (data.get("mixture") or []) if hasattr(source, "get")]
    eval_sets = data.get("eval_sets") or {}
    targets += [(entry, "path", DATA_SUFFIXES) if hasattr(entry, "get") else (eval_sets, name, DATA_SUFFIXES)
                for name, entry in eval_sets.items()]  # {name: path} or {name: {path: ..., ...}}
    for section, key, suffixes in targets:
        value = section.get(key) if hasattr(section, "get") else None
        if isinstance(value, str) and _is_relative_path(value, base, suffixes):
            section[key] = os.path.abspath(base / value)


DATA_SUFFIXES = (".json", ".jsonl", ".parquet")


def _is_relative_path(value: str, base: Path, suffixes) -> bool:
    if not value or "${" in value or "{{" in value or "{%" in value or value.startswith(("/", "~", "hf://")):
        return False
    from ftctl.models.aliases import is_alias

    if is_alias(value):
        return False
    return value.startswith(("./", "../")) or (base / value).exists() or value.lower().endswith(suffixes)


def line_of(path: Path, key: str) -> Optional[int]:
    try:
        return key_lines(path).get(key)
    except ConfigError:
        return None


def group_choice_as_keys(group_file: Path, group: str) -> List[str]:
    """A group preset (method=full) as key overrides, so that it wins over a config file that sets that section too."""
    from omegaconf import OmegaConf

    content = OmegaConf.load(group_file)
    content.pop("defaults", None)
    values = OmegaConf.to_container(content, resolve=True)
    return [f"{group}.{key}={_override_value(value)}" for key, value in values.items()]


def _override_value(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)
    if isinstance(value, list):
        return "[" + ",".join(_override_value(v) for v in value) + "]"
    return "'" + str(value).replace("\\", "\\\\").replace("'", "\\'") + "'"
