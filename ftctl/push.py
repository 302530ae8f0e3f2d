"""`ftctl push RUN_OR_RESULT REPO_ID`: a trained result on the Hugging Face Hub with a model card written from its run.

The result is a run dir (its ``final/`` is uploaded), a ``final/`` or ``checkpoints/step-N/`` dir, or a
dir or GGUF file made from a run (``ftctl merge``/``export``) with ``run=RUN_DIR`` naming that run. The
card (README.md) states the base model, the method, the data, the final metrics and the loss curve, and
carries the run's resolved config; its metadata is written and read back with huggingface_hub's own card
parser, and the Hub validates it before the upload. Without network the command fails in one line
after the hub probe (ftctl.models.hub, at most 1.5 s); nothing is uploaded then.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Dict, List, Optional

from ftctl.errors import FtctlError

log = logging.getLogger("ftctl")

#: `ftctl push` options (key=value) and what they mean.
PUSH_OPTIONS = {
    "private": "true to create the repo private (default false; an existing repo keeps its visibility)",
    "revision": "the branch to push to (created when missing; default main)",
    "commit_message": "the commit message (default: 'Upload <method> fine-tune of <base> with ftctl')",
    "run": "the run a merged/exported dir or GGUF file came from (its config and metrics go into the card)",
    "dry_run": "true: print the model card and the files that would be uploaded; nothing is contacted",
}
CARD_FILE = "README.md"
CONFIG_NAME = "ftctl_config.yaml"
METRICS_NAME = "ftctl_metrics.jsonl"
LOSS_CURVE = "loss_curve.png"
#: What a checkpoint holds beyond the loadable result: training state, never uploaded.
TRAINING_STATE_SUFFIXES = (".pt", ".pth")
TRAINING_STATE_FILES = ("trainer_state.json",)
METHOD_NAMES = {"lora": "LoRA", "qlora": "QLoRA", "dora": "DoRA"}
#: Rows of the loss table in the card (evenly spaced over the run, the last one always).
LOSS_TABLE_ROWS = 12


@dataclass
class PushSource:
    result: Path  # the dir or GGUF file whose files are uploaded
    run_dir: Path
    config: dict  # the run's resolved config (config.yaml)
    config_text: str
    metrics: List[dict]  # metrics.jsonl rows up to the result's step
    step: Optional[int]  # the checkpoint's step, None for the final result
    files: Dict[str, Path] = field(default_factory=dict)  # repo path -> local file


def _run_dir_of(path: Path) -> Optional[Path]:
    for candidate in (path, path.parent, path.parent.parent):
        if (candidate / "config.yaml").is_file() and ((candidate / "final").is_dir() or (candidate / "checkpoints").is_dir()):
            return candidate
    return None


def resolve_source(target: str, run: Optional[str] = None) -> PushSource:
    """What ``target`` uploads and the run that made it; one clear error when either is missing."""
    import yaml

    from ftctl.training.metrics import read_metrics

    path = Path(target).expanduser()
    if not path.exists():
        raise FtctlError(f"push: {target}: no such run dir, result dir or GGUF file")
    run_dir = Path(run).expanduser() if run else _run_dir_of(path)
    if run_dir is None or not (run_dir / "config.yaml").is_file():
        raise FtctlError(
            f"push: {run or target} is not an ftctl run (no config.yaml beside final/ or checkpoints/); push a run dir, its "
            "final/ or a checkpoints/step-N/ dir, or name the run a merged or exported result came from with run=RUN_DIR"
        )
    result = path / "final" if (path / "final").is_dir() and path.resolve() == run_dir.resolve() else path
    step = None
    if result.parent.name == "checkpoints" and result.name.startswith("step-"):
        step = int(result.name.removeprefix("step-"))
    text = (run_dir / "config.yaml").read_text()
    config = yaml.safe_load(text) or {}
    metrics = [row for row in read_metrics(run_dir) if step is None or row.get("step", 0) <= step]
    source = PushSource(result=result, run_dir=run_dir, config=config, config_text=text, metrics=metrics, step=step)
    source.files = _result_files(result)
    if not source.files:
        raise FtctlError(f"push: {result} holds no model files to upload")
    return source


def _result_files(result: Path) -> Dict[str, Path]:
    if result.is_file():
        return {result.name: result}
    return {
        item.name: item for item in sorted(result.iterdir())
        if item.is_file() and item.name != CARD_FILE and not item.name.startswith(".")
        and item.suffix not in TRAINING_STATE_SUFFIXES and item.name not in TRAINING_STATE_FILES
    }


def _is_adapter(source: PushSource) -> bool:
    return "adapter_config.json" in source.files


def _hub_model_id(name: str) -> Optional[str]:
    """The Hub id of a base model as a run names it: an id as written, an alias's origin; None for a local dir."""
    from ftctl.models.aliases import hub_origin, is_alias

    if is_alias(name):
        return hub_origin(name)
    path = Path(name).expanduser()
    if path.exists() or name.startswith((".", "/", "~")) or name.count("/") != 1:
        return None
    return name


def _data_sources(config: dict) -> List[tuple]:
    """(what the card says, the Hub dataset id or None) for every training source of the run."""
    data = config.get("data") or {}
    named = [(m.get("path"), m.get("weight")) for m in data.get("mixture") or []] or [(data.get("path"), None)]
    found = []
    for value, weight in named:
        if not value:
            continue
        value = str(value)
        hub_id = value.removeprefix("hf://").strip("/") if value.startswith("hf://") else None
        if hub_id is None and not Path(value).expanduser().exists() and value.count("/") == 1 and not value.startswith((".", "/", "~")):
            hub_id = value
        label = f"[{hub_id}](https://huggingface.co/datasets/{hub_id})" if hub_id else f"`{Path(value).name}` (a local file)"
        found.append((label + (f", weight {weight}" if weight is not None else ""), hub_id))
    return found


def _method_text(config: dict) -> str:
    method = config.get("method") or {}
    name = str(method.get("name", "unknown"))
    if name == "full":
        return "Full fine-tuning"
    name = METHOD_NAMES.get(name, name)
    if method.get("use_dora") and name != "DoRA":
        name += " with DoRA"
    details = [f"r={method['r']}" if "r" in method else "", f"alpha={method['alpha']}" if "alpha" in method else ""]
    targets = method.get("target_modules")
    if targets:
        details.append("on " + ", ".join(map(str, targets)))
    return f"{name} ({', '.join(d for d in details if d)})"


def final_metrics(rows: List[dict]) -> Dict[str, float]:
    """The numbers the card reports: the last step, its train loss (mean over its log window), the last held-out loss, trained tokens."""
    losses = [r for r in rows if isinstance(r.get("loss"), (int, float)) and math.isfinite(r["loss"])]
    evals = [r for r in rows if isinstance(r.get("eval_loss"), (int, float)) and math.isfinite(r["eval_loss"])]
    out = {}
    if rows:
        out["steps"] = max(int(r.get("step", 0)) for r in rows)
    if losses:
        out["train_loss"] = losses[-1]["loss"]
    if evals:
        out["eval_loss"] = evals[-1]["eval_loss"]
        out["eval_perplexity"] = math.exp(min(evals[-1]["eval_loss"], 700.0))
    tokens = sum(int(r.get("trained_tokens", 0)) for r in rows)
    if tokens:
        out["trained_tokens"] = tokens
    return out


def _loss_table(rows: List[dict]) -> str:
    by_step: Dict[int, dict] = {}
    for row in rows:
        for key in ("loss", "eval_loss"):
            if isinstance(row.get(key), (int, float)) and math.isfinite(row[key]):
                by_step.setdefault(int(row["step"]), {})[key] = row[key]
    steps = sorted(by_step)
    if not steps:
        return "No losses were logged."
    stride = max(1, math.ceil(len(steps) / LOSS_TABLE_ROWS))
    chosen = sorted(set(steps[::stride]) | {steps[-1]} | {s for s in steps if "eval_loss" in by_step[s]})
    cell = lambda value: f"{value:.4f}" if value is not None else ""  # noqa: E731
    lines = ["| step | train loss | held-out loss |", "|---:|---:|---:|"]
    lines += [f"| {s} | {cell(by_step[s].get('loss'))} | {cell(by_step[s].get('eval_loss'))} |" for s in chosen]
    return "\n".join(lines)


def card_metadata(source: PushSource, library: str):
    """The card's YAML metadata as huggingface_hub's ModelCardData."""
    from huggingface_hub import ModelCardData

    base = str((source.config.get("model") or {}).get("name_or_path", ""))
    method = str((source.config.get("method") or {}).get("name", ""))
    datasets = [hub_id for _, hub_id in _data_sources(source.config) if hub_id]
    tags = ["ftctl", method] + (["gguf"] if library == "gguf" else []) + (["peft"] if library == "peft" else [])
    return ModelCardData(
        base_model=_hub_model_id(base), library_name=library, pipeline_tag="text-generation",
        tags=list(dict.fromkeys(t for t in tags if t)), datasets=datasets or None,
    )


def build_card(source: PushSource, repo_id: str, has_curve: bool) -> str:
    """README.md for ``repo_id``: metadata, then what was trained, on what, how it ended, and the resolved config."""
    from huggingface_hub import ModelCard

    library = "gguf" if source.result.suffix == ".gguf" else ("peft" if _is_adapter(source) else "transformers")
    metadata = card_metadata(source, library)
    base = str((source.config.get("model") or {}).get("name_or_path", "unknown"))
    from ftctl.models.aliases import aliases

    if metadata.base_model:
        base_text = f"[{metadata.base_model}](https://huggingface.co/{metadata.base_model})"
    else:
        base_text = f"`{base}`" + ("" if base in aliases() else " (a local model)")
    if base in aliases():
        base_text += f" (ftctl's model alias `{base}`: {aliases()[base]})"
    what = {"peft": "a PEFT adapter; load it on top of its base model", "transformers": "a full transformers model",
            "gguf": "one GGUF file for llama.cpp"}[library]
    train = source.config.get("train") or {}
    numbers = final_metrics(source.metrics)
    metric_lines = [f"| {label} | {value} |" for label, value in (
        ("optimizer steps", numbers.get("steps")),
        ("final train loss", f"{numbers['train_loss']:.4f}" if "train_loss" in numbers else None),
        ("final held-out loss", f"{numbers['eval_loss']:.4f}" if "eval_loss" in numbers else None),
        ("held-out perplexity", f"{numbers['eval_perplexity']:.2f}" if "eval_perplexity" in numbers else None),
        ("trained tokens", f"{numbers['trained_tokens']:,}" if "trained_tokens" in numbers else None),
    ) if value is not None]
    data = (source.config.get("data") or {})
    sources = "\n".join(f"- {label}" for label, _ in _data_sources(source.config)) or "- (not recorded)"
    checkpoint = f" This is the checkpoint of step {source.step}." if source.step is not None else ""
    body = [
        f"# {repo_id.split('/')[-1]}",
        "",
        f"{_method_text(source.config)} of {base_text}, trained and uploaded with ftctl. "
        f"This repo holds {what}.{checkpoint}",
        "",
        "## Training data",
        "",
        sources,
        "",
        f"Format `{data.get('format', 'unknown')}`, up to {data.get('max_seq_len', '?')} tokens per example"
        + (f", chat template `{data['chat_template']}`" if data.get("chat_template") else "") + ". Held-out data: "
        + (f"`{Path(str(data['eval_path'])).name}`" if data.get("eval_path") else
           f"{data['eval_fraction']:.0%} of the training sources" if data.get("eval_fraction") else "none") + ".",
        "",
        "## Training",
        "",
        f"{train.get('max_steps') or train.get('epochs')} {'steps' if train.get('max_steps') else 'epochs'}, global batch "
        f"{train.get('global_batch_size')}, learning rate {train.get('lr')} ({train.get('lr_scheduler')}), "
        f"precision {(source.config.get('precision') or {}).get('name')}, seed {source.config.get('seed')}.",
        "",
        "## Final metrics",
        "",
        "| metric | value |",
        "|---|---:|",
        *(metric_lines or ["| (no metrics were logged) | |"]),
        "",
        "## Loss curve",
        "",
        *([f"![loss curve]({LOSS_CURVE})", ""] if has_curve else []),
        _loss_table(source.metrics),
        "",
        "## Resolved config",
        "",
        f"The run's full config as ftctl resolved it (also in `{CONFIG_NAME}`; its metrics are in `{METRICS_NAME}`):",
        "",
        "```yaml",
        source.config_text.rstrip(),
        "```",
        "",
    ]
    content = f"---\n{metadata.to_yaml()}\n---\n\n" + "\n".join(body)
    parsed = ModelCard(content)  # huggingface_hub's parser: the metadata must read back as written
    if parsed.data.to_dict() != metadata.to_dict():
        raise FtctlError(f"push: the model card's metadata does not read back as written ({parsed.data.to_dict()} != {metadata.to_dict()})")
    return content


def upload_plan(source: PushSource, repo_id: str) -> Dict[str, object]:
    """Repo path -> local file or bytes: the result's files, the card, the run's config, metrics and loss curve."""
    curve = source.run_dir / LOSS_CURVE
    has_curve = curve.is_file() and source.step is None  # the picture shows the whole run; a checkpoint gets the table only
    plan: Dict[str, object] = dict(source.files)
    plan[CARD_FILE] = build_card(source, repo_id, has_curve).encode()
    plan[CONFIG_NAME] = source.config_text.encode()
    plan[METRICS_NAME] = "".join(json.dumps(row) + "\n" for row in source.metrics).encode()
    if has_curve:
        plan[LOSS_CURVE] = curve
    return plan


def push(target: str, repo_id: str, options: Dict[str, str]) -> str:
    """Upload ``target`` to ``repo_id`` (or print the plan with dry_run=true); returns the commit URL or the card."""
    from huggingface_hub.utils import HFValidationError, validate_repo_id

    from ftctl.options import bool_option

    try:
        validate_repo_id(repo_id)
    except HFValidationError as exc:
        raise FtctlError(f"push: REPO_ID {repo_id} is not a Hub repo id ({str(exc).splitlines()[0]}); write NAME or ORG/NAME") from None
    private, dry_run = (bool_option(key, options.get(key, "false")) for key in ("private", "dry_run"))
    source = resolve_source(target, options.get("run"))
    plan = upload_plan(source, repo_id)
    if dry_run:
        listing = "\n".join(f"  {name}" for name in plan)
        return f"{plan[CARD_FILE].decode()}\n--- would upload to {repo_id}:\n{listing}"

    from ftctl.models.hub import hub_unreachable_reason

    reason = hub_unreachable_reason()
    if reason:
        raise FtctlError(f"push: the Hugging Face Hub cannot be reached ({reason}); nothing was uploaded. dry_run=true shows the card and files")
    base = str((source.config.get("model") or {}).get("name_or_path", "a model"))
    message = options.get("commit_message") or f"Upload {(source.config.get('method') or {}).get('name', '')} fine-tune of {base} with ftctl"
    return _upload(plan, repo_id, private=private, revision=options.get("revision"), message=message)


def _upload(plan: Dict[str, object], repo_id: str, *, private: bool, revision: Optional[str], message: str) -> str:
    from huggingface_hub import CommitOperationAdd, HfApi, ModelCard
    from huggingface_hub.errors import HfHubHTTPError, LocalTokenNotFoundError

    api = HfApi()
    try:
        ModelCard(plan[CARD_FILE].decode()).validate()  # the Hub's own metadata check, before anything is created
        url = api.create_repo(repo_id, private=private, exist_ok=True)
        if revision:
            api.create_branch(repo_id, branch=revision, exist_ok=True)
        operations = [CommitOperationAdd(path_in_repo=name, path_or_fileobj=str(item) if isinstance(item, Path) else item)
                      for name, item in plan.items()]
        commit = api.create_commit(repo_id, operations, commit_message=message, revision=revision)
    except LocalTokenNotFoundError:
        raise FtctlError("push: not logged in to the Hugging Face Hub; run `hf auth login` or set HF_TOKEN") from None
    except (HfHubHTTPError, ValueError, OSError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        hint = "; check HF_TOKEN (`hf auth login`) and that it may write to this repo" if "401" in first or "403" in first else ""
        raise FtctlError(f"push to {repo_id} failed: {first}{hint}") from None
    log.info("pushed %d files to %s", len(plan), url)
    return getattr(commit, "commit_url", None) or str(url)
