"""Named eval sets (``data.eval_sets``) and the eval metrics a training run logs and selects by.

A set is written ``{name: source}`` or ``{name: {path, format, split, subset, metric}}``; both are read
here into :class:`ftctl.config.schema.EvalSet`, with the defaults of the rest of ``data``. Training logs
``eval_loss`` for data.eval_path / eval_fraction and ``eval/<name>_loss`` for each named set (plus
``eval/<name>_perplexity`` when the set lists perplexity); ``train.best_metric`` names one of them.
Torch-free: ``ftctl train`` checks all of it before anything loads, and ``ftctl eval`` reads its
``data.eval_sets=`` option through the same function.
"""

from __future__ import annotations

import dataclasses
import re
from typing import Dict, List, Mapping

from ftctl.config.schema import EvalSet
from ftctl.errors import ConfigError, did_you_mean

_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")
#: The metrics line key of the default eval split (data.eval_path or data.eval_fraction).
DEFAULT_EVAL_KEY = "eval_loss"
#: Metrics `ftctl eval` computes by generating answers; too costly to run at every eval of a training run.
GENERATION_METRICS = ("exact_match", "json_match", "rouge_l")
EVAL_METRICS = ("auto", *GENERATION_METRICS, "perplexity")


def named_eval_sets(mapping: Mapping, key: str = "data.eval_sets") -> Dict[str, EvalSet]:
    """``{name: EvalSet}`` in the mapping's order; a wrong name, field or metric is one ConfigError naming ``key``."""
    if not isinstance(mapping, Mapping):
        raise ConfigError(f"{key} is a mapping of named sets, e.g. {{orders: a.jsonl, chat: {{path: b.jsonl, format: sharegpt}}}}")
    fields = [f.name for f in dataclasses.fields(EvalSet)]
    sets = {}
    for name, value in mapping.items():
        name = str(name)
        where = f"{key}.{name}"
        if not _NAME.match(name) or name == "eval":
            raise ConfigError(f"{where}: a set's name is letters, digits, '_' and '-', and not 'eval' (it names "
                              "eval/<name>_loss, which trackers would mix up with eval_loss)")
        if isinstance(value, str):
            value = {"path": value}
        if not isinstance(value, Mapping):
            raise ConfigError(f"{where}: give a source (file, directory, saved or hub dataset) or {{path: ..., format: ...}}")
        unknown = [k for k in value if k not in fields]
        if unknown:
            raise ConfigError(f"{where}.{unknown[0]}: not a field of an eval set.{did_you_mean(str(unknown[0]), fields)} "
                              f"Fields: {', '.join(fields)}")
        if not value.get("path"):
            raise ConfigError(f"{where}.path has no value; name the set's file, directory, saved or hub dataset")
        entry = EvalSet(**{k: (str(v) if v is not None else None) for k, v in value.items()})
        metric_names(entry.metric, f"{where}.metric")
        sets[name] = entry
    return sets


def metric_names(value: str, key: str = "metric") -> List[str]:
    """The metrics a comma-separated ``value`` lists, each checked (``auto`` included, resolved later)."""
    names = [part.strip() for part in str(value).split(",") if part.strip()]
    if not names:
        raise ConfigError(f"{key} is empty; choose from {', '.join(EVAL_METRICS)}")
    for name in names:
        if name not in EVAL_METRICS:
            raise ConfigError(f"{key}: unknown metric '{name}'.{did_you_mean(name, EVAL_METRICS)} Available: {', '.join(EVAL_METRICS)}")
    return list(dict.fromkeys(names))


def set_metric_key(name: str, metric: str) -> str:
    """The metrics line key of a named set's value: eval/orders_loss, eval/orders_perplexity."""
    return f"eval/{name}_{metric}"


def training_eval_keys(data) -> List[str]:
    """The eval values a training run with this DataConfig logs, in the order it logs them."""
    keys = [DEFAULT_EVAL_KEY] if data.eval_path or data.eval_fraction > 0 else []
    for name, entry in named_eval_sets(data.eval_sets).items():
        keys.append(set_metric_key(name, "loss"))
        if "perplexity" in metric_names(entry.metric):
            keys.append(set_metric_key(name, "perplexity"))
    return keys


def check_best_metric(cfg) -> None:
    """train.best_metric must be a value the run logs, when keep_best or early stopping compares it."""
    t = cfg.train
    if t.early_stopping_patience < 0:
        raise ConfigError(f"train.early_stopping_patience={t.early_stopping_patience} must be >= 0 (0 = never stop early)")
    if t.early_stopping_threshold < 0:
        raise ConfigError(f"train.early_stopping_threshold={t.early_stopping_threshold} must be >= 0")
    if not (t.keep_best or t.early_stopping_patience):
        return
    using = "train.keep_best" if t.keep_best else "train.early_stopping_patience"
    logged = training_eval_keys(cfg.data)
    if not logged:
        raise ConfigError(f"{using} compares evals, but the run has no eval data; set data.eval_path, data.eval_fraction "
                          "or data.eval_sets")
    metric = t.best_metric
    if metric in logged:
        return
    match = re.match(r"^eval/(?P<name>.+)_(?P<metric>[a-z]+)$", metric)
    if metric.startswith("eval/") and metric.endswith(tuple("_" + m for m in GENERATION_METRICS)):
        raise ConfigError(f"train.best_metric={metric}: generation metrics are scored by `ftctl eval`, not at every eval "
                          f"of a run; choose one the run logs: {', '.join(logged)}")
    if match and match.group("metric") == "perplexity" and set_metric_key(match.group("name"), "loss") in logged:
        raise ConfigError(f"train.best_metric={metric}: add perplexity to data.eval_sets.{match.group('name')}.metric "
                          f"to log it, or choose {set_metric_key(match.group('name'), 'loss')} (the same order)")
    raise ConfigError(f"train.best_metric={metric} is not logged by this run.{did_you_mean(metric, logged)} "
                      f"It logs: {', '.join(logged)}")
