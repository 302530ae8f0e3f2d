"""Strict per-example metrics: a prediction scores 1 or 0, and a score is the share that scored 1.

``exact_match`` compares the texts after trimming surrounding whitespace. ``json_match`` asks that the
whole prediction be one JSON value equal to the reference's: whitespace and object key order do not
matter, anything else does (a code fence or a sentence around the JSON, 3 for "3", 3.0 for 3).
"""

from __future__ import annotations

import json
from typing import Callable, Dict, List, Sequence

from ftctl.errors import ConfigError, did_you_mean


def exact_match(prediction: str, reference: str) -> bool:
    return prediction.strip() == reference.strip()


def _canonical_json(text: str):
    try:
        value = json.loads(text.strip())
    except ValueError:
        return None
    # Canonical text keeps types apart that Python's == merges (1 == 1.0 == True).
    return json.dumps(value, sort_keys=True, ensure_ascii=False)


def json_match(prediction: str, reference: str) -> bool:
    expected = _canonical_json(reference)
    return expected is not None and _canonical_json(prediction) == expected


METRICS: Dict[str, Callable[[str, str], bool]] = {"exact_match": exact_match, "json_match": json_match}


def is_json_container(text: str) -> bool:
    try:
        return isinstance(json.loads(text), (dict, list))
    except ValueError:
        return False


def choose_metric(name: str, references: Sequence[str]) -> str:
    """The metric to use: ``name``, or for ``auto`` json_match when every reference is a JSON object or array."""
    if name == "auto":
        return "json_match" if references and all(is_json_container(r) for r in references) else "exact_match"
    if name not in METRICS:
        raise ConfigError(f"unknown metric '{name}'.{did_you_mean(name, METRICS)} Available: auto, {', '.join(METRICS)}")
    return name


def score(metric: str, predictions: Sequence[str], references: Sequence[str]) -> List[bool]:
    check = METRICS[metric]
    return [check(p, r) for p, r in zip(predictions, references)]
