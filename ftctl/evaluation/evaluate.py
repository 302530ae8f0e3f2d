"""`ftctl eval`: generate on a held-out file and score the answers with a strict metric.

Each record becomes a conversation through the same data_formats converter and chat template as in
training; the prompt is the conversation up to its last assistant turn and the reference is that
turn. Results go to ``<output>/eval.json`` (metric, score, n, and what was evaluated) and every
prediction to ``<output>/predictions.jsonl``.
"""

from __future__ import annotations

import json
import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional, Tuple

from data_formats import FormatError, get_format, guess_format, other_format_hint
from ftctl.data.render import trains
from ftctl.errors import FtctlError
from ftctl.options import number_option
from ftctl.trained_run import trained_model_config, trained_system_prompt

log = logging.getLogger("ftctl")

Messages = List[Dict[str, str]]


@dataclass
class EvalRequest:
    data_path: str
    output: str
    model: Optional[str] = None
    adapter: Optional[str] = None
    data_format: Optional[str] = None
    n: int = 0
    max_new_tokens: int = 64
    batch_size: int = 16
    metric: str = "auto"
    system_prompt: Optional[str] = None
    chat_template: Optional[str] = None


@dataclass
class HeldOutExample:
    prompt: Messages
    reference: str
    source: str


def held_out_examples(path: str | Path, data_format: Optional[str], system_prompt: Optional[str] = None, n: int = 0) -> Tuple[str, List[HeldOutExample]]:
    """(format used, the first ``n`` examples of ``path`` (all when n is 0) split into prompt and reference)."""
    from ftctl.data.records import read_records

    records = read_records(path)
    if not records:
        raise FtctlError(f"{path}: the file holds no examples")
    if data_format is None:
        guesses = guess_format(records[0].data)
        if not guesses:
            raise FtctlError(f"{records[0].source}: cannot tell the record format; set data.format")
        data_format = guesses[0]
    fmt = get_format(data_format)
    examples = []
    for record in records[: n or None]:
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
    return data_format, examples


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


def run_eval(req: EvalRequest) -> dict:
    from ftctl.evaluation.generation import generate
    from ftctl.evaluation.scoring import choose_metric, score

    data_format, examples = held_out_examples(req.data_path, req.data_format, req.system_prompt, req.n)
    metric = choose_metric(req.metric, [e.reference for e in examples])
    model_name, adapter_dir = resolve_targets(req.model, req.adapter)
    net, tokenizer = load_for_generation(model_name, adapter_dir, req.chat_template)
    if model_name is None:
        model_name = json.loads((adapter_dir / "adapter_config.json").read_text()).get("base_model_name_or_path")
    log.info(
        "eval: %d examples of %s (%s), model %s%s, metric %s",
        len(examples), req.data_path, data_format, model_name, f" + adapter {adapter_dir}" if adapter_dir else "", metric,
    )
    start = time.perf_counter()
    predictions = generate(net, tokenizer, [e.prompt for e in examples], req.max_new_tokens, batch_size=req.batch_size, progress="eval")
    seconds = time.perf_counter() - start
    correct = score(metric, predictions, [e.reference for e in examples])

    out = Path(req.output).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "predictions.jsonl", "w") as f:
        for example, prediction, ok in zip(examples, predictions, correct):
            row = {"source": example.source, "prompt": example.prompt, "reference": example.reference,
                   "prediction": prediction, "correct": ok}
            f.write(json.dumps(row, ensure_ascii=False) + "\n")
    summary = {
        "metric": metric,
        "score": sum(correct) / len(correct),
        "n": len(correct),
        "correct": sum(correct),
        "model": model_name,
        "adapter": str(adapter_dir) if adapter_dir else None,
        "data": str(req.data_path),
        "data_format": data_format,
        "max_new_tokens": req.max_new_tokens,
        "generation_seconds": round(seconds, 2),
    }
    (out / "eval.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


#: `ftctl eval` options (key=value) and what they mean; `recipe=` fills model and data.* from a preset.
EVAL_OPTIONS = {
    "model": "model alias, dir or hub id; a full fine-tune's run dir; omitted: the adapter's base model",
    "adapter": "LoRA/DoRA/QLoRA result: a run dir or its final/ (or a checkpoint dir)",
    "recipe": "take model, data.format, data.system_prompt, data.chat_template and data.eval_path from a preset",
    "data.path": "held-out file (.jsonl, .json or .parquet); default with recipe=: its data.eval_path",
    "data.format": "alpaca, sharegpt, openai, ...; default: guessed from the first record",
    "data.system_prompt": "system message added to examples that carry none (default: the one the run trained with)",
    "data.chat_template": "chat template overriding the tokenizer's: a name, Jinja or a .jinja file (as in training)",
    "output": "dir for eval.json and predictions.jsonl (default runs/eval-<time>)",
    "n": "evaluate the first n examples (default: all)",
    "max_new_tokens": "tokens generated per answer at most (default 64)",
    "batch_size": "conversations generated together (default 16)",
    "metric": "auto (json_match when every reference is JSON, else exact_match), exact_match or json_match",
}


def request_from_overrides(overrides: List[str]) -> EvalRequest:
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
    defaults: Dict[str, Optional[str]] = {}
    if "recipe" in values:
        from ftctl.config.compose import compose_config

        cfg = compose_config([f"recipe={values['recipe']}"])
        defaults = {
            "model": cfg.model.name_or_path, "data.path": cfg.data.eval_path, "data.format": cfg.data.format,
            "data.system_prompt": cfg.data.system_prompt, "data.chat_template": cfg.data.chat_template,
        }
        if "adapter" in values:
            defaults.pop("model")  # the adapter names its own base
    get = lambda key: values.get(key, defaults.get(key))  # noqa: E731
    if not get("data.path"):
        raise ConfigError("say which held-out file to evaluate on: data.path=FILE")

    def integer(key: str, default: int, minimum: int) -> int:
        return number_option(values, key, int, default, minimum, error=ConfigError)

    return EvalRequest(
        data_path=get("data.path"),
        output=values.get("output") or time.strftime("runs/eval-%Y%m%d-%H%M%S"),
        model=get("model"),
        adapter=values.get("adapter"),
        data_format=get("data.format"),
        n=integer("n", 0, 0),
        max_new_tokens=integer("max_new_tokens", 64, 1),
        batch_size=integer("batch_size", 16, 1),
        metric=values.get("metric", "auto"),
        system_prompt=get("data.system_prompt") if "data.system_prompt" in values or "recipe" in values
        else trained_system_prompt(values.get("adapter"), values.get("model")),
        chat_template=get("data.chat_template"),
    )
