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
    from ftctl.parallel.mesh_shape import data_parallel_size

    data_ranks = data_parallel_size(cfg, world)
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
        f"  objective  {_objective(cfg)}",
        f"  parallel   {p.name} × {world} process{'es' if world > 1 else ''} ({p.nproc_per_node} per node × {p.nnodes} node{'s' if p.nnodes > 1 else ''})",
        f"  precision  {precision}",
        f"  data       {_data_sources(d)} (max_seq_len {d.max_seq_len}, {'packed' if d.packing else 'padded'} micro-batches"
        + (f", eval {d.eval_path or f'{d.eval_fraction:.0%} held out'}" if d.eval_path or d.eval_fraction else "") + ")",
        f"  batch      global {t.global_batch_size} = micro {t.micro_batch_size} × {data_ranks} {'data-parallel ' if data_ranks != world else ''}"
        f"rank{'s' if data_ranks > 1 else ''} × {gradient_accumulation_steps(cfg, world)} accumulation; {_length(t)}, lr {t.lr:g} {t.lr_scheduler}",
        *_evals(cfg),
        f"  output     {output}",
        "",
    ]
    try:
        estimate = estimate_for(cfg)
    except ConfigError as exc:
        estimate = None
        lines.append(f"memory estimate unavailable: {exc}")
    if p.name == "mesh":
        lines[4:4] = _mesh_lines(cfg, world, estimate)
    if estimate is not None:
        lines.append(format_table(estimate))
    return "\n".join(lines)


def _mesh_lines(cfg: RunConfig, world: int, estimate) -> list:
    """The mesh, which layers each pipeline stage holds, and the pipeline's bubble."""
    from ftctl.parallel.mesh_shape import mesh_shape, microbatches, stages_per_rank

    p = cfg.parallel
    try:
        shape = mesh_shape(p, world)
    except ValueError as exc:
        return [f"  mesh       {exc}"]
    lines = [f"  mesh       {shape.describe()} = {world} ranks (device mesh axes pp, dp_replicate, dp_shard, tp)"]
    if shape.pp > 1 and estimate is not None:
        m = microbatches(cfg, gradient_accumulation_steps(cfg, world))
        v = stages_per_rank(p)
        lines += [f"  stages     {line}" for line in estimate.stages]
        formula = f"(p−1)/({'v·' if v > 1 else ''}m+p−1) = {shape.pp - 1}/({f'{v}·' if v > 1 else ''}{m}+{shape.pp - 1})"
        lines.append(f"  pipeline   {p.pp_schedule}, {m} micro-batches a step; bubble {formula} = {estimate.bubble_ratio:.1%}")
    return lines


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
def _objective(cfg: RunConfig) -> str:
    o = cfg.objective
    if o.name == "sft":
        return "sft (next-token cross-entropy on the answers)"
    settings = {"dpo": f"{o.loss_type}, beta {o.beta:g}" + (f", label_smoothing {o.label_smoothing:g}" if o.label_smoothing else ""),
                "simpo": f"beta {o.beta:g}, gamma {o.gamma:g}", "orpo": f"lambda {o.orpo_lambda:g}",
                "kto": f"beta {o.beta:g}, weights {o.desirable_weight:g}/{o.undesirable_weight:g}"}[o.name]
    if o.sft_weight:
        settings += f", sft_weight {o.sft_weight:g}"
    if o.name in ("dpo", "kto"):
        fresh = cfg.method.name != "full" and not cfg.model.adapter
        reference = "precomputed once and cached" if o.precompute_reference else (
            "the model with its adapter disabled" if fresh else "a frozen copy of the starting model")
        settings += f"; reference: {reference}"
    return f"{o.name} ({settings})"


def _length(t) -> str:
    if t.epochs is not None:
        return f"{t.epochs:g} epochs (steps counted after tokenization)"
    return f"{t.max_steps} steps"


def _data_sources(d) -> str:
    if not d.mixture:
        return f"{d.format} {d.path}"
    total = sum(s.weight for s in d.mixture)
    return "mixture of " + ", ".join(f"{s.weight / total:.0%} {s.format or d.format} {s.path}" for s in d.mixture)
