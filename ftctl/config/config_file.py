"""A recipe file the user keeps anywhere (`ftctl train --config my.yaml`), read with the line of every key.

The file is a recipe: the same keys, an optional Hydra ``defaults`` list of group choices, composed
and validated exactly as a preset in recipes/recipe/ is. Mistakes are reported as ``FILE:LINE``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Dict, List, Optional

import yaml

from ftctl.errors import ConfigError

#: The name the file is registered under in the recipe group, so Hydra composes it as a preset.
CONFIG_FILE_RECIPE = "_config_file"


def key_lines(path: Path) -> Dict[str, int]:
    """Each dotted key the file sets, with its 1-based line ("defaults" is Hydra's, not a key)."""
    try:
        root = yaml.compose(path.read_text())
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None) or getattr(exc, "context_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise ConfigError(f"{where}: not valid YAML: {getattr(exc, 'problem', None) or exc}") from None
    except OSError as exc:
        raise ConfigError(f"--config {path}: {exc.strerror}") from None
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


def load_config_file(path: Path, fields, unknown_key_hint, free_key=lambda key: False):
    """The file's content, after refusing keys the schema does not have (with the file's line); ``free_key``
    tells the entries of mapping-typed keys (data.eval_sets.NAME), which the user names."""
    from omegaconf import OmegaConf

    lines = key_lines(path)
    sections = {key.rsplit(".", 1)[0] for key in fields if "." in key}
    for key, line in lines.items():
        if key not in fields and key not in sections and not free_key(key):
            raise ConfigError(f"{path}:{line}: unknown config key '{key}'.{unknown_key_hint(key, fields)} "
                              "(`ftctl config-docs` lists every key)")
    return OmegaConf.load(path)


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
