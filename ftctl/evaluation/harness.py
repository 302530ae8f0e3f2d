"""A bridge to lm-evaluation-harness (`lm-eval`): its tasks run on a model ftctl loaded, in this process.

The model is what ``ftctl eval`` loads (an adapter merged in memory, a full fine-tune, a merged dir,
an alias), handed to lm-eval's ``HFLM`` as a model object, so nothing is written or converted first.
``harness_include=DIR`` indexes only the task YAML files of DIR (lm-eval's ``--include_path``; fast,
and the user's own tasks); without it lm-eval's built-in tasks are indexed (some 15 000 files, tens of
seconds). A task's data comes through ``datasets``: local ``data_files`` need no network, and when the
Hub cannot be reached (or ``HF_HUB_OFFLINE``/``HF_DATASETS_OFFLINE`` is set) the run is offline, so a
hub dataset must be in the local cache.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Dict, List, Optional

from ftctl.errors import FtctlError, did_you_mean

log = logging.getLogger("ftctl")


@dataclass
class HarnessRequest:
    tasks: List[str]
    include: Optional[str] = None  # a dir of task YAML files; None: lm-eval's built-in tasks
    fewshot: Optional[int] = None  # None: each task's own num_fewshot
    chat: bool = False  # render prompts with the model's chat template (and the system prompt)
    system_prompt: Optional[str] = None
    limit: int = 0  # examples per task; 0 = all
    batch_size: int = 16


def _lm_eval():
    try:
        import lm_eval
        from lm_eval.models.huggingface import HFLM
        from lm_eval.tasks import TaskManager
    except ImportError:
        raise FtctlError("harness= needs lm-evaluation-harness: pip install 'ftctl[eval]'") from None
    return lm_eval, HFLM, TaskManager


def task_manager(include: Optional[str], tasks: List[str]):
    """lm-eval's TaskManager over ``include`` (or the built-in tasks), with every requested task known to it."""
    _, _, TaskManager = _lm_eval()
    if include is not None:
        folder = Path(include).expanduser()
        if not folder.is_dir():
            raise FtctlError(f"harness_include={include}: no such directory; give the dir of your task YAML files")
        manager = TaskManager(include_path=str(folder), include_defaults=False)
    else:
        manager = TaskManager()
    known = manager.all_tasks
    for task in tasks:
        if task not in known:
            where = f"the task YAML files of {include}" if include is not None else "lm-eval's built-in tasks (harness_include=DIR adds yours)"
            listing = f" Tasks there: {', '.join(known)}" if include is not None and len(known) <= 30 else ""
            raise FtctlError(f"harness={task}: not among {where}.{did_you_mean(task, known)}{listing}")
    return manager


@contextlib.contextmanager
def _offline_when_unreachable():
    """datasets reads its offline switch at import; the Hub probe decides it for this run."""
    from ftctl.data.sources import hub_unreachable_reason

    reason = hub_unreachable_reason()
    if not reason:
        yield
        return
    import datasets

    saved_flag, saved_env = datasets.config.HF_HUB_OFFLINE, {k: os.environ.get(k) for k in ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")}
    datasets.config.HF_HUB_OFFLINE = True
    os.environ.update({"HF_DATASETS_OFFLINE": "1", "HF_HUB_OFFLINE": "1"})
    log.info("harness: offline (%s); task data must be local or in the datasets cache", reason)
    try:
        yield
    finally:
        datasets.config.HF_HUB_OFFLINE = saved_flag
        for key, value in saved_env.items():
            os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)


def _not_about_the_model_object(record: logging.LogRecord) -> bool:
    """HFLM warns that a model object skips its loading arguments: ftctl loaded it, on purpose."""
    return not record.getMessage().startswith(("`pretrained` model kwarg is not of type", "Passed an already-initialized model"))


@contextlib.contextmanager
def _quiet(level: int):
    """lm-eval logs every request stage at INFO; ftctl's own lines say what runs."""
    logger, hflm = logging.getLogger("lm_eval"), logging.getLogger("lm_eval.models.huggingface")
    saved = logger.level
    logger.setLevel(level)
    hflm.addFilter(_not_about_the_model_object)
    try:
        yield
    finally:
        logger.setLevel(saved)
        hflm.removeFilter(_not_about_the_model_object)


def run_harness(model, tokenizer, req: HarnessRequest, output: Path, manager=None) -> Dict[str, Dict[str, float]]:
    """Run the tasks on ``model``; writes ``output/harness.json`` (lm-eval's results, versions, n-shot and
    configs) and ``output/harness_samples.jsonl``; returns ``{task: {metric: value}}``. ``manager``: the
    :func:`task_manager` already built, when the tasks were checked before the model loaded."""
    lm_eval, HFLM, _ = _lm_eval()
    from lm_eval.utils import handle_non_serializable

    manager = manager or task_manager(req.include, req.tasks)
    debug = logging.getLogger("ftctl").isEnabledFor(logging.DEBUG)
    from ftctl.progress import library_bars_follow_rule

    with _quiet(logging.INFO if debug else logging.WARNING), _offline_when_unreachable(), library_bars_follow_rule():
        lm = HFLM(pretrained=model, tokenizer=tokenizer, batch_size=req.batch_size)
        try:
            results = lm_eval.simple_evaluate(
                model=lm, tasks=list(req.tasks), task_manager=manager, num_fewshot=req.fewshot,
                limit=req.limit or None, apply_chat_template=req.chat,
                system_instruction=req.system_prompt if req.chat else None, log_samples=True,
            )
        except FtctlError:
            raise
        except Exception as exc:  # lm-eval and datasets raise many types; each names its cause in its first line
            first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise FtctlError(f"harness={','.join(req.tasks)}: lm-eval failed: {first}") from exc
    scores = {task: {key: value for key, value in values.items() if isinstance(value, (int, float)) and not isinstance(value, bool)}
              for task, values in results["results"].items()}
    output.mkdir(parents=True, exist_ok=True)
    kept = {key: results.get(key) for key in ("results", "groups", "versions", "n-shot", "higher_is_better", "n-samples", "configs")}
    (output / "harness.json").write_text(json.dumps(kept, indent=2, default=handle_non_serializable) + "\n")
    with open(output / "harness_samples.jsonl", "w") as f:
        for task, samples in (results.get("samples") or {}).items():
            for sample in samples:
                f.write(json.dumps({"task": task, **sample}, default=handle_non_serializable, ensure_ascii=False) + "\n")
    return scores
