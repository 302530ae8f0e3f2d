"""What `ftctl train --dry-run` prints: the resolved run in a few lines and its memory estimate. No torch."""

from __future__ import annotations

from pathlib import Path

from ftctl.config.schema import RunConfig
from ftctl.config.validate import gradient_accumulation_steps
from ftctl.errors import ConfigError
from ftctl.estimate import estimate_for, format_table, machine_precision


def describe_run(cfg: RunConfig) -> str:
    m, p, d, t = cfg.method, cfg.parallel, cfg.data, cfg.train
    world = p.nproc_per_node * p.nnodes
    if m.name == "full":
        method = "full (every weight trains)"
    else:
        targets = ",".join(m.target_modules)
        method = f"{m.name} r={m.r} alpha={m.alpha:g} dropout={m.dropout:g} targets={targets}"
        if m.name == "qlora":
            method += f" ({m.quant_type}{', double quant' if m.double_quant else ''})"
    precision = cfg.precision.name
    if precision == "auto":
        precision = f"auto -> {machine_precision('auto')} on this machine"
    out = Path(cfg.output_dir).expanduser()
    if out.exists() and any(out.iterdir()):
        output = f"{out} (not empty: training {'overwrites it' if cfg.overwrite else 'refuses unless overwrite=true'})"
    else:
        output = f"{out} (created when training starts)"
    lines = [
        "plan (dry run: nothing is loaded, trained or written)",
        f"  model      {cfg.model.name_or_path}",
        f"  method     {method}",
        f"  parallel   {p.name} × {world} process{'es' if world > 1 else ''} ({p.nproc_per_node} per node × {p.nnodes} node{'s' if p.nnodes > 1 else ''})",
        f"  precision  {precision}",
        f"  data       {_data_sources(d)} (max_seq_len {d.max_seq_len}, {'packed' if d.packing else 'padded'} micro-batches"
        + (f", eval {d.eval_path or f'{d.eval_fraction:.0%} held out'}" if d.eval_path or d.eval_fraction else "") + ")",
        f"  batch      global {t.global_batch_size} = micro {t.micro_batch_size} × {world} rank{'s' if world > 1 else ''} × "
        f"{gradient_accumulation_steps(cfg, world)} accumulation; {_length(t)}, lr {t.lr:g} {t.lr_scheduler}",
        *_evals(cfg),
        f"  output     {output}",
        "",
    ]
    try:
        lines.append(format_table(estimate_for(cfg)))
    except ConfigError as exc:
        lines.append(f"memory estimate unavailable: {exc}")
    return "\n".join(lines)


def _evals(cfg) -> list:
    """The evals line: what is logged every train.eval_every steps, and what keep_best / early stopping compare."""
    from ftctl.config.eval_sets import training_eval_keys

    t, keys = cfg.train, training_eval_keys(cfg.data)
    if not keys:
        return []
    when = f"every {t.eval_every} steps and at the end" if t.eval_every else "at the end"
    extra = ([f"best/ by {t.best_metric}"] if t.keep_best else []) + (
        [f"early stopping after {t.early_stopping_patience} evals without a better {t.best_metric}"] if t.early_stopping_patience else [])
    return [f"  evals      {', '.join(keys)} {when}" + (f"; {'; '.join(extra)}" if extra else "")]


def _length(t) -> str:
    if t.epochs is not None:
        return f"{t.epochs:g} epochs (steps counted after tokenization)"
    return f"{t.max_steps} steps"


def _data_sources(d) -> str:
    if not d.mixture:
        return f"{d.format} {d.path}"
    total = sum(s.weight for s in d.mixture)
    return "mixture of " + ", ".join(f"{s.weight / total:.0%} {s.format or d.format} {s.path}" for s in d.mixture)
