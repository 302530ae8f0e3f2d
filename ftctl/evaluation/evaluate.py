"""`ftctl eval`: score held-out data by generating answers (exact/JSON match, ROUGE-L), by perplexity, and by
lm-evaluation-harness tasks.

The held-out data is one source (``data.path``: a file, a directory, a saved or a hub dataset, read
as training reads ``data.path``) or several named ones (``data.eval_sets``). Each record becomes a
conversation through the same data_formats converter and chat template as in training; the prompt is
the conversation up to its last assistant turn and the reference is that turn. Perplexity scores the
answer tokens exactly as training trains them (:mod:`ftctl.evaluation.perplexity`). Results go to
``<output>/eval.json`` and every prediction to ``<output>/predictions.jsonl`` (one source) or
``predictions-<name>.jsonl`` (named sets); harness results to ``harness.json``.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Dict, List, Optional, Tuple

from data_formats import AUTO, FormatError, detect_format, get_format, other_format_hint
from ftctl.data.render import trains
from ftctl.data.sources import DataSource, locate, read_source
from ftctl.errors import FtctlError
from ftctl.options import number_option
from ftctl.trained_run import trained_model_config, trained_run_config, trained_system_prompt

if TYPE_CHECKING:
    from ftctl.config.schema import DataConfig, EvalSet

log = logging.getLogger("ftctl")

Messages = List[Dict[str, str]]
#: Where the split of a saved dataset dict or a hub dataset comes from when nothing names one (as data.eval_split).
DEFAULT_SPLIT = "test"


@dataclass
class EvalRequest:
    data_path: Optional[str] = None  # one held-out source: eval.json is that set's summary
    output: str = "runs/eval"
    model: Optional[str] = None
    adapter: Optional[str] = None
    data_format: Optional[str] = None
    n: int = 0
    max_new_tokens: int = 64
    batch_size: int = 16
    metric: Optional[str] = None  # None: each named set's own metric, else auto
    system_prompt: Optional[str] = None
    chat_template: Optional[str] = None
    data_split: str = DEFAULT_SPLIT
    data_subset: Optional[str] = None
    eval_sets: Dict[str, EvalSet] = field(default_factory=dict)  # named sources: eval.json has a summary per set
    max_seq_len: int = 0  # perplexity's truncation; 0: the run's data.max_seq_len, else the schema default
    train_on_prompt: bool = False  # perplexity also over prompt tokens, when the run trained them
    harness: List[str] = field(default_factory=list)
    harness_include: Optional[str] = None
    harness_fewshot: Optional[int] = None
    harness_chat: bool = False


@dataclass
class HeldOutExample:
    prompt: Messages
    reference: str
    source: str


def read_held_out(source: DataSource, data_format: Optional[str], n: int = 0):
    """(format used, the first ``n`` records of ``source``, all when n is 0); the format is guessed when not given."""
    records = read_source(source)
    if not records:
        raise FtctlError(f"{source.value}: the {'file' if source.kind == 'file' else 'dataset'} holds no examples")
    if data_format in (None, AUTO):
        try:
            data_format, why = detect_format(records[0].data)
        except FormatError as exc:
            raise FtctlError(f"{records[0].source}: {exc}") from None
        log.info("%s: %s (data.format=auto: %s)", source.describe(), data_format, why)
    get_format(data_format)
    return data_format, records[: n or None]


def held_out_examples(path, data_format: Optional[str], system_prompt: Optional[str] = None, n: int = 0, *,
                      key: str = "data.path", split: str = DEFAULT_SPLIT, subset: Optional[str] = None) -> Tuple[str, List[HeldOutExample]]:
    """(format used, the first ``n`` examples of ``path`` (all when n is 0) split into prompt and reference).

    ``path`` is anything data.path takes (or a located DataSource).
    """
    source = path if isinstance(path, DataSource) else locate(str(path), key, split, subset)
    data_format, records = read_held_out(source, data_format, n)
    return data_format, split_examples(records, data_format, system_prompt)


def split_examples(records, data_format: str, system_prompt: Optional[str] = None) -> List[HeldOutExample]:
    fmt = get_format(data_format)
    if fmt.plain_text:
        raise FtctlError(f"data.format={data_format} records have no answer to generate; score them with metric=perplexity")
    examples = []
    for record in records:
        try:
            messages = fmt.to_messages(record.data)
        except FormatError as exc:
            hint = other_format_hint(record.data, data_format)
            raise FtctlError(f"{record.source}: not a valid '{data_format}' record: {exc}.{hint}") from None
        if system_prompt and messages[0]["role"] != "system":
            messages = [{"role": "system", "content": system_prompt}] + messages
        answers = [i for i, m in enumerate(messages) if trains(m, messages[:i])]  # what training would train on
        if not answers:
            raise FtctlError(f"{record.source}: no assistant turn after a prompt to score")
        last = answers[-1]
        examples.append(HeldOutExample(messages[:last], messages[last]["content"], record.source))
    return examples


def resolve_targets(model: Optional[str], adapter: Optional[str]) -> Tuple[Optional[str], Optional[Path]]:
    """(base model name or dir, or None for the adapter's own base; adapter dir or None). A run dir stands for its final/."""
    adapter_dir = _adapter_dir(adapter, "adapter") if adapter else None
    if model:
        path = Path(model).expanduser()
        result = path / "final" if (path / "final").is_dir() else path
        if adapter_dir is None and (result / "adapter_config.json").is_file() and not (result / "config.json").is_file():
            adapter_dir, model = result, None  # model= given an adapter result: evaluate it on its base
        elif (result / "config.json").is_file():
            model = str(result)  # a model dir, or a full fine-tune's run dir: its final/
    if model is None and adapter_dir is None:
        raise FtctlError("say what to evaluate: model=NAME_OR_DIR and/or adapter=RUN_OR_ADAPTER_DIR")
    return model, adapter_dir


def _adapter_dir(value: str, key: str) -> Path:
    path = Path(value).expanduser()
    for candidate in (path, path / "final"):
        if (candidate / "adapter_config.json").is_file():
            return candidate
    raise FtctlError(f"{key}={value}: no adapter_config.json there or in its final/; pass a LoRA, DoRA or QLoRA result dir")


def load_model(model: Optional[str], adapter_dir: Optional[Path] = None):
    """(fp32 model on the CPU with any adapter merged in, its tokenizer) for what resolve_targets found.

    ``model`` is an alias, model dir (a full fine-tune's result, a merged dir), hub id or ``.gguf``
    file. An adapter is merged the way `ftctl merge` does it (a QLoRA adapter into the dequantised
    4-bit base it trained against); its base is ``model``, or the one its adapter_config.json names.
    eval, chat, generate and export all load through here.
    """
    import torch

    from ftctl.config.schema import ModelConfig
    from ftctl.models.loading import load_causal_lm, load_tokenizer, resolve_model_path

    if adapter_dir is not None:
        from ftctl.merging import merge_adapter

        return merge_adapter(adapter_dir, base=model, base_key="model")
    if model.lower().endswith(".gguf"):
        from ftctl.models.gguf_import import load_gguf

        return load_gguf(Path(model).expanduser())
    model_path = resolve_model_path(model, key="model")
    tokenizer = load_tokenizer(ModelConfig(name_or_path=model), model_path)
    return load_causal_lm(trained_model_config(model, model), model_path, dtype=torch.float32), tokenizer


def load_for_generation(model: Optional[str], adapter_dir: Optional[Path] = None, chat_template: Optional[str] = None):
    """(model in eval mode on the best device, tokenizer with the chat template training used); see load_model."""
    import torch

    from ftctl.data.render import ensure_chat_template

    net, tokenizer = load_model(model, adapter_dir)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    ensure_chat_template(tokenizer, chat_template)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type == "cuda" and torch.cuda.is_bf16_supported():
        net = net.to(torch.bfloat16)
    return net.to(device).eval(), tokenizer


@dataclass
class HeldOutSet:
    """One source to score: ``name`` None for a lone data.path (eval.json is then its summary)."""

    name: Optional[str]
    source: DataSource
    data_format: Optional[str]
    metric: str


def held_out_sets(req: EvalRequest) -> List[HeldOutSet]:
    """The sources a request names, located (a missing file is a message before any model loads)."""
    sets = []
    if req.data_path:
        source = locate(req.data_path, "data.path", req.data_split, req.data_subset)
        sets.append(HeldOutSet(None, source, req.data_format, req.metric or "auto"))
    for name, entry in req.eval_sets.items():
        source = locate(entry.path, f"data.eval_sets.{name}.path", entry.split or req.data_split,
                        entry.subset if entry.subset is not None else req.data_subset)
        sets.append(HeldOutSet(name, source, entry.format or req.data_format, req.metric or entry.metric))
    return sets


def run_eval(req: EvalRequest) -> dict:
    """Score every set of the request (and the harness tasks) on one loaded model; returns what eval.json holds."""
    from ftctl.paths import check_output_path

    check_output_path(Path(req.output), "output", directory=True)  # before the model loads
    sets = held_out_sets(req)
    if not sets and not req.harness:
        raise FtctlError("say what to evaluate on: data.path=SOURCE, data.eval_sets={name: SOURCE, ...} or harness=TASK")
    model_name, adapter_dir = resolve_targets(req.model, req.adapter)
    tasks = None
    if req.harness:  # an unknown task or include dir is a message before the model loads
        from ftctl.evaluation.harness import task_manager

        tasks = task_manager(req.harness_include, req.harness)
    net, tokenizer = load_for_generation(model_name, adapter_dir, req.chat_template)
    if model_name is None:
        model_name = json.loads((adapter_dir / "adapter_config.json").read_text()).get("base_model_name_or_path")
    what = f"model {model_name}" + (f" + adapter {adapter_dir}" if adapter_dir else "")
    out = Path(req.output).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    target = {"model": model_name, "adapter": str(adapter_dir) if adapter_dir else None}
    summaries = {}
    for held_out in sets:
        summary, rows = _score_set(net, tokenizer, held_out, req, what)
        name = "predictions.jsonl" if held_out.name is None else f"predictions-{held_out.name}.jsonl"
        if rows:
            with open(out / name, "w") as f:
                f.writelines(json.dumps(row, ensure_ascii=False) + "\n" for row in rows)
        summaries[held_out.name] = summary
    if None in summaries:  # one data.path: its summary is the file, as before named sets existed
        result = {**summaries.pop(None), **target}
    else:
        result = {**target, "sets": summaries} if summaries else dict(target)
    if req.harness:
        from ftctl.evaluation.harness import HarnessRequest, run_harness

        log.info("eval: lm-eval harness tasks %s on %s", ", ".join(req.harness), what)
        result["harness"] = run_harness(net, tokenizer, HarnessRequest(
            req.harness, req.harness_include, req.harness_fewshot, req.harness_chat, req.system_prompt, req.n, req.batch_size), out, tasks)
    (out / "eval.json").write_text(json.dumps(result, indent=2) + "\n")
    return result


def _score_set(net, tokenizer, held_out: HeldOutSet, req: EvalRequest, what: str) -> Tuple[dict, List[dict]]:
    """(the set's summary, one row per prediction) for every metric the set asks for."""
    from ftctl.evaluation.scoring import METRICS, PERPLEXITY, choose_metrics

    data_format, records = read_held_out(held_out.source, held_out.data_format, req.n)
    key = "metric" if req.metric or held_out.name is None else f"data.eval_sets.{held_out.name}.metric"
    plain_text = get_format(data_format).plain_text
    examples = [] if plain_text else split_examples(records, data_format, req.system_prompt)
    metric_value = "perplexity" if plain_text and held_out.metric == "auto" else held_out.metric
    metrics = choose_metrics(metric_value, [e.reference for e in examples], key)
    generated = [m for m in metrics if m != PERPLEXITY]
    if generated and plain_text:
        split_examples(records, data_format)  # says why there is nothing to generate
    label = held_out.source.describe() + (f" ({held_out.name})" if held_out.name else "")
    log.info("eval: %d examples of %s (%s), %s, metric %s", len(records), label, data_format, what, ", ".join(metrics))
    summary = {"metric": metrics[0], "score": None, "n": len(records), "metrics": {},
               "data": held_out.source.value, "data_format": data_format}
    rows: List[dict] = []
    if generated:
        from ftctl.evaluation.generation import generate
        from ftctl.evaluation.scoring import score

        start = time.perf_counter()
        predictions = generate(net, tokenizer, [e.prompt for e in examples], req.max_new_tokens, batch_size=req.batch_size,
                               progress="eval" if held_out.name is None else f"eval {held_out.name}")
        summary.update(max_new_tokens=req.max_new_tokens, generation_seconds=round(time.perf_counter() - start, 2))
        references = [e.reference for e in examples]
        per_metric = {m: score(m, predictions, references) for m in generated}
        for m, values in per_metric.items():
            summary["metrics"][m] = sum(values) / len(values)
        strict = metrics[0] if metrics[0] in METRICS else None  # "correct" counts the first metric, when it is strict
        if strict is not None:
            summary["correct"] = sum(per_metric[strict])
        for i, (example, prediction) in enumerate(zip(examples, predictions)):
            row = {"source": example.source, "prompt": example.prompt, "reference": example.reference, "prediction": prediction}
            if strict is not None:
                row["correct"] = per_metric[strict][i]
            row["scores"] = {m: per_metric[m][i] for m in generated}
            rows.append(row)
    if PERPLEXITY in metrics:
        from ftctl.evaluation.perplexity import perplexity

        measured = perplexity(net, tokenizer, records, held_out.source, data_format, _perplexity_data_config(req, data_format),
                              req.batch_size)
        summary["metrics"][PERPLEXITY] = measured.perplexity
        summary[PERPLEXITY] = measured.as_dict()
    summary["metrics"] = {m: summary["metrics"][m] for m in metrics}  # in the order asked
    summary["score"] = summary["metrics"][metrics[0]]
    return summary, rows


def _perplexity_data_config(req: EvalRequest, data_format: str) -> DataConfig:
    """Tokenization as the run trained: its format settings, with the request's prompt and template."""
    from ftctl.config.schema import DataConfig

    return DataConfig(format=data_format, max_seq_len=req.max_seq_len or DataConfig().max_seq_len, train_on_prompt=req.train_on_prompt,
                      system_prompt=req.system_prompt, chat_template=req.chat_template)


#: `ftctl eval` options (key=value) and what they mean; `recipe=` or --config fills model and the data keys from a config.
EVAL_OPTIONS = {
    "model": "model alias, dir or hub id; a full fine-tune's run dir; omitted: the adapter's base model",
    "adapter": "LoRA/DoRA/QLoRA result: a run dir or its final/ (or best/, or a checkpoint dir)",
    "recipe": "take model and the data keys (data.eval_path, data.eval_sets, ...) from a preset; --config FILE from a file",
    "data.path": "held-out data: a .jsonl/.json/.parquet file, a dir of them, a save_to_disk dir or a hub dataset id",
    "data.eval_sets": "named held-out sets, {name: SOURCE, name2: {path: SOURCE, format: sharegpt, metric: rouge_l}}",
    "data.format": "alpaca, sharegpt, openai, text, ...; default: guessed from the first record",
    "data.split": "split of a saved dataset dict or a hub dataset (default: the config's data.eval_split, else test)",
    "data.subset": "hub dataset subset (configuration)",
    "data.system_prompt": "system message added to examples that carry none (default: the one the run trained with)",
    "data.chat_template": "chat template overriding the tokenizer's: a name, Jinja or a .jinja file (as in training)",
    "data.max_seq_len": "perplexity: tokens per example, longer ones truncated (default: the run's, else 512)",
    "output": "dir for eval.json and the predictions (default runs/eval-<time>)",
    "n": "evaluate the first n examples of each set, and of each harness task (default: all)",
    "max_new_tokens": "tokens generated per answer at most (default 64)",
    "batch_size": "examples run together (default 16)",
    "metric": "auto (json_match when every reference is JSON, else exact_match), exact_match, json_match, rouge_l, "
              "perplexity, or several joined by commas; default: auto, or each named set's own",
    "harness": "lm-evaluation-harness task(s), comma-separated, run on the same model",
    "harness_include": "dir of your own lm-eval task YAML files (only they are indexed); default: lm-eval's built-in tasks",
    "harness_fewshot": "few-shot examples per harness prompt (default: each task's own)",
    "harness_chat": "true: render harness prompts with the model's chat template and system prompt (default false)",
}


def request_from_overrides(overrides: List[str], config_file: Optional[str] = None) -> EvalRequest:
    """Read `ftctl eval` key=value arguments into a request; unknown keys are a ConfigError."""
    from ftctl.errors import ConfigError, did_you_mean

    values: Dict[str, str] = {}
    for item in overrides:
        key, sep, value = item.partition("=")
        if not sep:
            raise ConfigError(f"cannot read '{item}': write key=value, for example n=50")
        if key not in EVAL_OPTIONS:
            raise ConfigError(f"unknown eval option '{key}'.{did_you_mean(key, EVAL_OPTIONS)} Options: {', '.join(EVAL_OPTIONS)}")
        values[key] = value
    if "recipe" in values and config_file:
        raise ConfigError(f"pass recipe=NAME or --config {config_file}, not both")
    cfg = None
    if "recipe" in values or config_file:
        from ftctl.config.compose import compose_config

        # Eval reads held-out data (data.eval_path, data.eval_sets), not necessarily training data.
        cfg = compose_config([f"recipe={values['recipe']}"] if "recipe" in values else [], config_file, needs_data=False)
    run = trained_run_config(values.get("adapter"), values.get("model"))
    defaults: Dict[str, object] = {}
    source_cfg = cfg or run  # a run evaluates on its own held-out data unless told otherwise
    # A run's own held-out data is the default only when nothing else is asked for; a recipe's or a file's always.
    own_data = "data.path" not in values and "data.eval_sets" not in values and (cfg is not None or "harness" not in values)
    if source_cfg is not None:
        d = source_cfg.data
        defaults = {"data.system_prompt": d.system_prompt, "data.chat_template": d.chat_template, "data.split": d.eval_split,
                    "data.subset": d.subset, "data.max_seq_len": d.max_seq_len}
        if cfg is not None or own_data:  # a run's format describes its own data, not a file given here
            defaults["data.format"] = d.format
        if own_data:
            defaults.update({"data.path": d.eval_path, "data.eval_sets": dict(d.eval_sets)})
            if d.eval_path and d.eval_sets:  # both: the eval_path becomes the set named eval
                defaults["data.eval_sets"] = {"eval": {"path": d.eval_path}, **d.eval_sets}
                defaults["data.path"] = None
        if cfg is not None and "adapter" not in values:
            defaults["model"] = cfg.model.name_or_path  # with an adapter, the adapter names its own base
    get = lambda key: values.get(key, defaults.get(key))  # noqa: E731
    eval_sets = get("data.eval_sets") or {}
    if isinstance(eval_sets, str):
        eval_sets = _mapping_option("data.eval_sets", eval_sets)
    from ftctl.config.eval_sets import metric_names, named_eval_sets

    harness = [task.strip() for task in values.get("harness", "").split(",") if task.strip()]
    if not get("data.path") and not eval_sets and not harness:
        raise ConfigError("say what to evaluate on: data.path=SOURCE (a file, a dir, a saved or hub dataset), "
                          "data.eval_sets={name: SOURCE, ...} or harness=TASK")
    if "metric" in values:
        metric_names(values["metric"])

    def integer(key: str, default: int, minimum: int) -> int:
        return number_option(values, key, int, default, minimum, error=ConfigError)

    system_prompt = get("data.system_prompt") if "data.system_prompt" in values or cfg is not None \
        else trained_system_prompt(values.get("adapter"), values.get("model"))
    return EvalRequest(
        data_path=get("data.path"),
        output=values.get("output") or time.strftime("runs/eval-%Y%m%d-%H%M%S"),
        model=get("model"),
        adapter=values.get("adapter"),
        data_format=get("data.format"),
        n=integer("n", 0, 0),
        max_new_tokens=integer("max_new_tokens", 64, 1),
        batch_size=integer("batch_size", 16, 1),
        metric=values.get("metric"),
        system_prompt=system_prompt,
        chat_template=get("data.chat_template"),
        data_split=get("data.split") or DEFAULT_SPLIT,
        data_subset=get("data.subset"),
        eval_sets=named_eval_sets(eval_sets, "data.eval_sets"),
        max_seq_len=integer("data.max_seq_len", int(defaults.get("data.max_seq_len") or 0), 16),
        train_on_prompt=bool(source_cfg.data.train_on_prompt) if source_cfg is not None else False,
        harness=harness,
        harness_include=values.get("harness_include"),
        harness_fewshot=integer("harness_fewshot", 0, 0) if "harness_fewshot" in values else None,
        harness_chat=_boolean(values, "harness_chat"),
    )


def _mapping_option(key: str, text: str) -> dict:
    """A YAML flow mapping given on the command line, {a: x.jsonl, b: {path: y.jsonl, format: sharegpt}}."""
    import yaml

    from ftctl.errors import ConfigError

    try:
        value = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{key}: cannot read '{text}' as a mapping ({getattr(exc, 'problem', exc)}); write {{name: file.jsonl, ...}}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{key}={text}: write a mapping of named sets, {{name: file.jsonl, name2: {{path: dir/, format: sharegpt}}}}")
    return value


def _boolean(values: Dict[str, str], key: str) -> bool:
    from ftctl.errors import ConfigError

    raw = values.get(key, "false").lower()
    if raw not in ("true", "false"):
        raise ConfigError(f"{key}={values[key]}: expected true or false")
    return raw == "true"
