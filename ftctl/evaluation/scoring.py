"""Per-example metrics of generated answers; a set's score is their mean.

``exact_match`` compares the texts after trimming surrounding whitespace. ``json_match`` asks that the
whole prediction be one JSON value equal to the reference's: whitespace and object key order do not
matter, anything else does (a code fence or a sentence around the JSON, 3 for "3", 3.0 for 3). Both
score 1 or 0. ``rouge_l`` is the ROUGE-L F-measure of the `rouge-score` package (Google's reference
implementation; its tokenizer lowercases and keeps ASCII letters and digits, no stemming), from 0 to 1.
Perplexity needs no generated answer; it is computed by :mod:`ftctl.evaluation.perplexity`.
"""

from __future__ import annotations

import functools
import json
from typing import Callable, Dict, List, Sequence, Union

from ftctl.errors import ConfigError, FtctlError, did_you_mean


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


def rouge_l(prediction: str, reference: str) -> float:
    return _rouge_scorer().score(reference, prediction)["rougeL"].fmeasure


@functools.lru_cache(maxsize=1)
def _rouge_scorer():
    try:
        from rouge_score import rouge_scorer
    except ImportError:
        raise FtctlError("metric=rouge_l needs the rouge-score package: pip install 'ftctl[eval]'") from None
    return rouge_scorer.RougeScorer(["rougeL"], use_stemmer=False)


#: Strict metrics: a prediction scores 1 or 0.
METRICS: Dict[str, Callable[[str, str], bool]] = {"exact_match": exact_match, "json_match": json_match}
#: Graded metrics: a prediction scores from 0 to 1.
GRADED: Dict[str, Callable[[str, str], float]] = {"rouge_l": rouge_l}
PERPLEXITY = "perplexity"


def is_json_container(text: str) -> bool:
    try:
        return isinstance(json.loads(text), (dict, list))
    except ValueError:
        return False


def choose_metric(name: str, references: Sequence[str]) -> str:
    """The metric to use: ``name``, or for ``auto`` json_match when every reference is a JSON object or array."""
    if name == "auto":
        return "json_match" if references and all(is_json_container(r) for r in references) else "exact_match"
    known = [*METRICS, *GRADED, PERPLEXITY]
    if name not in known:
        raise ConfigError(f"unknown metric '{name}'.{did_you_mean(name, known)} Available: auto, {', '.join(known)}")
    return name


def choose_metrics(value: str, references: Sequence[str], key: str = "metric") -> List[str]:
    """The metrics a comma-separated ``value`` lists (auto resolved as in :func:`choose_metric`), in order, once each."""
    from ftctl.config.eval_sets import metric_names

    return list(dict.fromkeys(choose_metric(name, references) if name == "auto" else name for name in metric_names(value, key)))


def score(metric: str, predictions: Sequence[str], references: Sequence[str]) -> List[Union[bool, float]]:
    check = METRICS.get(metric) or GRADED[metric]
    return [check(p, r) for p, r in zip(predictions, references)]
