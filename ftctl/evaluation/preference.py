"""`ftctl eval` on a held-out preference file: how often a model prefers the chosen answer, and by how much.

Each pair is rendered exactly as preference training renders it (:mod:`ftctl.data.preference`), and a
model's summed log-probability of each answer gives, over the file:

- ``accuracy``: the share of pairs whose chosen answer is the more likely one (a tie counts as wrong);
- ``mean_margin``: the mean of log p(chosen) − log p(rejected).

Given a trained result (``adapter=``, or ``model=`` a full fine-tune's run dir) both the base model and
the trained one are scored, and the trained model's implicit DPO reward against the base,
β·((log p − log p_base)(chosen) − (log p − log p_base)(rejected)), gives ``reward_accuracy`` and
``reward_margin`` (β is the run's ``objective.beta``, else 0.1). ``eval.json`` holds the summary,
``predictions.jsonl`` every pair's log-probabilities.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path
from typing import Dict, List, Optional

from ftctl.errors import FtctlError

log = logging.getLogger("ftctl")

DEFAULT_BETA = 0.1


def is_preference_eval(data_path: str, data_format: Optional[str]) -> bool:
    """Whether `ftctl eval` should score pairs: the format says so, or (unset or auto) the first record has two answers."""
    from data_formats import AUTO, get_format

    if data_format not in (None, AUTO) and not get_format(data_format).gives_conversations:
        return True
    from ftctl.data.records import iter_records

    path = Path(data_path).expanduser() if data_path else None
    if path is None or not path.is_file():
        return False
    first = next(iter_records(path), None)  # the first record only: the file may be large
    return first is not None and "chosen" in first.data and "rejected" in first.data


def pair_format(req) -> str:
    """The format to read ``req``'s pairs with: data.format, or (auto) the format that reads the file's first record
    as a pair (data.format=auto's rule for pairs). Checks every pair now, before any model loads."""
    from data_formats import AUTO, PAIRS, detect_format, get_format
    from ftctl.data.preference import read_preference_records

    first = next(_records(req), None)
    if first is None:
        raise FtctlError(f"{req.data_path}: the file holds no examples")
    data_format = req.data_format if req.data_format != AUTO else None
    if data_format is not None and not get_format(data_format).gives_pairs:
        if get_format(data_format).gives_unpaired:
            raise FtctlError(f"data.format={data_format}: ftctl eval scores preference pairs; a KTO file has one answer per prompt")
        data_format = None
    if data_format is None:
        data_format, _ = detect_format(first.data, PAIRS)
    for _ in read_preference_records(_records(req), data_format, PAIRS):
        pass
    return data_format


def _records(req):
    """The file's first ``req.n`` records (all when 0), one at a time."""
    import itertools

    from ftctl.data.records import iter_records

    return itertools.islice(iter_records(req.data_path), req.n or None)


def _pairs(req, data_format: str, tokenizer, max_seq_len: int):
    from ftctl.config.schema import DataConfig
    from ftctl.data.preference import PAIRS, tokenize_preference
    from ftctl.data.sources import locate

    cfg = DataConfig(format=data_format, path=str(req.data_path), max_seq_len=max_seq_len, system_prompt=req.system_prompt)
    return tokenize_preference(_records(req), locate(str(req.data_path), "data.path"), data_format, cfg, tokenizer, PAIRS)


def score_pairs(model, tokenizer, data, batch_size: int = 8):
    """(chosen, rejected) summed log-probs of every pair under ``model``, as two lists."""
    import torch

    from ftctl.data.preference import PreferenceBatching
    from ftctl.objectives.logprobs import sequence_logps
    from ftctl.progress import progress_bar

    batching = PreferenceBatching(batch_size, tokenizer.pad_token_id, 8, 0)
    device = next(model.parameters()).device
    chosen, rejected = [], []
    bar = progress_bar(len(data), "score pairs", unit="pair")
    try:
        for batch in batching(data, list(range(len(data)))):
            with torch.no_grad():
                logps = sequence_logps(model, batch, device).double().cpu()
            chosen += logps[0::2].tolist()
            rejected += logps[1::2].tolist()
            if bar is not None:
                bar.update(batch.examples)
    finally:
        if bar is not None:
            bar.close()
    return chosen, rejected


def summarize(chosen: List[float], rejected: List[float]) -> Dict[str, float]:
    margins = [c - r for c, r in zip(chosen, rejected)]
    return {"accuracy": sum(m > 0 for m in margins) / len(margins), "mean_margin": sum(margins) / len(margins)}


def run_preference_eval(req) -> dict:
    """Score the pairs of ``req.data_path`` with the model (and its base, for a trained result); write eval.json."""
    from ftctl.evaluation.evaluate import load_for_generation, resolve_targets
    from ftctl.trained_run import trained_run_config

    data_format = pair_format(req)
    model_name, adapter_dir = resolve_targets(req.model, req.adapter)
    run = trained_run_config(str(adapter_dir) if adapter_dir else None, req.model)
    beta = run.objective.beta if run is not None and run.objective.name == "dpo" else DEFAULT_BETA
    max_seq_len = run.data.max_seq_len if run is not None else 2048
    trained, tokenizer = load_for_generation(model_name, adapter_dir, req.chat_template)
    if adapter_dir is not None:
        base_name = model_name or json.loads((adapter_dir / "adapter_config.json").read_text()).get("base_model_name_or_path")
    else:
        base_name = run.model.name_or_path if run is not None else None  # a full fine-tune's run: its starting model
    data = _pairs(req, data_format, tokenizer, max_seq_len)
    log.info("eval: %d preference pairs of %s (%s), model %s%s", len(data), req.data_path, data_format,
             model_name or base_name, f" + adapter {adapter_dir}" if adapter_dir else "")
    scores = {"trained" if base_name else "model": score_pairs(trained, tokenizer, data, req.batch_size)}
    del trained
    if base_name:
        base, _ = load_for_generation(base_name, None, req.chat_template)
        scores["base"] = score_pairs(base, tokenizer, data, req.batch_size)
        del base
    evaluated = summarize(*scores["trained" if base_name else "model"])
    summary = {"metric": "preference_accuracy", "score": evaluated["accuracy"], **evaluated, "n": len(data),
               "correct": sum(c > r for c, r in zip(*scores["trained" if base_name else "model"])),
               "data": str(req.data_path), "data_format": data_format, "model": model_name or base_name,
               "adapter": str(adapter_dir) if adapter_dir else None}
    if base_name:
        (tc, tr), (bc, br) = scores["trained"], scores["base"]
        summary["base"], summary["trained"] = summarize(bc, br), evaluated
        rewards = [beta * ((c - b_c) - (r - b_r)) for c, r, b_c, b_r in zip(tc, tr, bc, br)]
        summary["reward"] = {"beta": beta, "accuracy": sum(x > 0 for x in rewards) / len(rewards),
                             "mean_margin": sum(rewards) / len(rewards)}
    out = Path(req.output).expanduser()
    out.mkdir(parents=True, exist_ok=True)
    with open(out / "predictions.jsonl", "w") as f:
        for i in range(len(data)):
            row = {name: {"chosen_logp": chosen[i], "rejected_logp": rejected[i]} for name, (chosen, rejected) in scores.items()}
            f.write(json.dumps({"pair": i, **row}) + "\n")
    (out / "eval.json").write_text(json.dumps(summary, indent=2) + "\n")
    return summary


def describe(summary: dict) -> str:
    """The one-line result `ftctl eval` prints."""
    if "base" not in summary:
        return (f"eval: preference accuracy {summary['accuracy']:.3f} ({summary['correct']}/{summary['n']} pairs), "
                f"mean margin {summary['mean_margin']:+.3f}")
    base, trained, reward = summary["base"], summary["trained"], summary["reward"]
    return (f"eval: preference accuracy base {base['accuracy']:.3f} -> trained {trained['accuracy']:.3f} ({summary['n']} pairs), "
            f"mean margin {base['mean_margin']:+.3f} -> {trained['mean_margin']:+.3f}; reward accuracy {reward['accuracy']:.3f}, "
            f"reward margin {reward['mean_margin']:+.3f}")
