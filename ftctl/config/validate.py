"""Checks on values that the type schema cannot express: ranges, choices and cross-field rules.

All of them run before torch is imported, so a mistake costs a message, not a model load.
"""

from __future__ import annotations

from ftctl.config.schema import (
    ATTENTION_KERNELS, DPO_LOSS_TYPES, KERNELS, LR_SCHEDULERS, METHODS, OBJECTIVES, OPTIMIZERS, PACKED_ATTENTION_KERNELS,
    PARALLEL_BACKENDS, PRECISIONS, PREFERENCE_OBJECTIVES, REFERENCE_OBJECTIVES, TRACKERS, WSD_DECAY_SHAPES, RunConfig,
)
from ftctl.errors import ConfigError, did_you_mean


def _choice(key: str, value: str, choices) -> None:
    if value not in choices:
        raise ConfigError(f"{key}='{value}' is not one of {', '.join(choices)}.{did_you_mean(value, choices)}")


def check_chat_template(key: str, template: str) -> None:
    """A template transformers would fail to compile is a message now, not a traceback at tokenization.
    ``template`` may also be a template's name or a .jinja file (ftctl.data.chat_templates)."""
    import jinja2
    from jinja2 import nodes
    from jinja2.ext import Extension, loopcontrols
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    class GenerationBlock(Extension):  # transformers' {% generation %}...{% endgeneration %} marks assistant text
        tags = {"generation"}

        def parse(self, parser):
            lineno = next(parser.stream).lineno
            return nodes.Scope(parser.parse_statements(("name:endgeneration",), drop_needle=True), lineno=lineno)

    from ftctl.data.chat_templates import resolve_chat_template

    template = resolve_chat_template(template, key)
    try:  # the environment transformers renders chat templates in
        environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[loopcontrols, GenerationBlock])
        environment.parse(template)
    except jinja2.TemplateSyntaxError as exc:
        raise ConfigError(f"{key} is not a valid Jinja template: {exc.message} (template line {exc.lineno})") from None


def _positive(key: str, value, *, allow_zero: bool = False) -> None:
    if value < 0 or (value == 0 and not allow_zero):
        raise ConfigError(f"{key}={value} must be {'>= 0' if allow_zero else '> 0'}")


#: Other tools' names for preference objectives, which ftctl sets with objective= (so that method=dpo is
#: answered with objective=dpo, not "corrected" to a method spelled alike: dpo is not dora).
OBJECTIVE_NAMES = {
    "dpo": "dpo", "ipo": "dpo objective.loss_type=ipo", "rdpo": "dpo objective.loss_type=robust", "slic": "dpo objective.loss_type=hinge",
    "simpo": "simpo", "orpo": "orpo", "kto": "kto", "cpo": "simpo", "sft": "sft",
}
#: RL methods of other tools that ftctl does not offer.
RL_METHODS = ("ppo", "grpo", "rlhf", "rloo", "reward", "rm", "online_dpo", "reinforce")


def refuse_unsupported_method(setting: str, name: str) -> None:
    """method=dpo and the like: point at the objective, or say that RL is not offered."""
    lowered = name.lower()
    if lowered in OBJECTIVE_NAMES and lowered != "sft":
        raise ConfigError(
            f"{setting}: {name} is an objective in ftctl, not a method: set objective={OBJECTIVE_NAMES[lowered]} "
            "and keep method=full, lora, qlora or dora"
        )
    if lowered in RL_METHODS:
        raise ConfigError(
            f"{setting}: RL (PPO, GRPO, RLOO, reward models) is not supported; ftctl trains with objective=sft, dpo, "
            "simpo, orpo or kto and method=full, lora, qlora or dora"
        )


def refuse_unknown_objective(setting: str, name: str) -> None:
    """objective=ipo, objective=ppo: the objective that means it, or that RL is not offered."""
    lowered = name.lower()
    if lowered in OBJECTIVE_NAMES and lowered not in OBJECTIVES:
        raise ConfigError(f"{setting}: ftctl's name for it is objective={OBJECTIVE_NAMES[lowered]}")
    if lowered in RL_METHODS:
        refuse_unsupported_method(setting, name)


def validate(cfg: RunConfig, needs_data: bool = True) -> None:
    m, t, d, p = cfg.method, cfg.train, cfg.data, cfg.parallel
    refuse_unsupported_method(f"method.name={m.name}", m.name)
    _choice("method.name", m.name, METHODS)
    _choice("parallel.name", p.name, PARALLEL_BACKENDS)
    _choice("precision.name", cfg.precision.name, PRECISIONS)
    if m.name in ("lora", "qlora", "dora"):
        _positive("method.r", m.r)
        _positive("method.alpha", m.alpha)
        if not 0.0 <= m.dropout < 1.0:
            raise ConfigError(f"method.dropout={m.dropout} must be in [0, 1)")
        if not m.target_modules:
            raise ConfigError("method.target_modules is empty; use [all-linear] or name the modules to adapt")
    if m.name == "dora" and not m.use_dora:
        raise ConfigError("method=dora needs method.use_dora=true (or use method=lora with use_dora=false)")
    if m.name == "full" and m.use_dora:
        raise ConfigError("method.use_dora=true needs an adapter method (dora, lora or qlora), not method=full")
    _choice("method.quant_type", m.quant_type, ("nf4", "fp4"))
    if cfg.model.adapter and m.name == "full":
        raise ConfigError(f"model.adapter={cfg.model.adapter} goes on training an adapter; use method=lora, qlora or dora "
                          "(or merge it first with `ftctl merge` and train the merged model with method=full)")
    _check_objective(cfg)
    _choice("method.quant_storage", m.quant_storage, ("uint8", "bfloat16", "float16", "float32"))

    _check_run_length(t)
    _positive("train.micro_batch_size", t.micro_batch_size)
    _positive("train.global_batch_size", t.global_batch_size)
    _positive("train.lr", t.lr)
    for key in ("warmup_steps", "log_every", "eval_every", "save_every", "keep_last", "num_threads", "max_nonfinite_steps",
                "divergence_window"):
        _positive(f"train.{key}", getattr(t, key), allow_zero=True)
    _positive("data.max_record_bytes", cfg.data.max_record_bytes, allow_zero=True)
    _positive("train.max_grad_norm", t.max_grad_norm, allow_zero=True)
    _positive("train.weight_decay", t.weight_decay, allow_zero=True)
    _positive("train.log_every", t.log_every)
    if not 0.0 <= t.min_lr_ratio <= 1.0:
        raise ConfigError(f"train.min_lr_ratio={t.min_lr_ratio} must be in [0, 1]")
    _choice("train.lr_scheduler", t.lr_scheduler, LR_SCHEDULERS)
    _choice("train.optimizer", t.optimizer, OPTIMIZERS)
    _check_training_options(t)
    for tracker in t.report_to:
        _choice("train.report_to", tracker, TRACKERS)

    _choice("model.attn_implementation", cfg.model.attn_implementation, ATTENTION_KERNELS)
    from data_formats import AUTO, get_format

    if d.format != AUTO:
        fmt = get_format(d.format)
        if cfg.objective.name == "sft" and not fmt.gives_conversations:
            raise ConfigError(f"data.format={d.format} holds preference data; train it with objective=dpo, simpo, orpo or kto")
    if needs_data and not d.path and not d.mixture:
        raise ConfigError("data.path has no value; set data.path=FILE (or a directory, a save_to_disk directory, a hub "
                          "dataset id) or data.mixture=[{path: ..., weight: ...}, ...]")
    for i, source in enumerate(d.mixture):
        if source.format and source.format != AUTO:
            get_format(source.format)
        if not source.weight > 0:
            raise ConfigError(f"data.mixture[{i}].weight={source.weight} must be > 0")
    from ftctl.config.eval_sets import check_best_metric, named_eval_sets

    for eval_set in named_eval_sets(d.eval_sets).values():
        if eval_set.format:
            get_format(eval_set.format)
    check_best_metric(cfg)
    if d.chat_template:
        check_chat_template("data.chat_template", d.chat_template)
    if d.add_special_tokens:
        from ftctl.data.chat_templates import TEMPLATE_SPECIAL_TOKENS

        named = [name for name, tokens in TEMPLATE_SPECIAL_TOKENS.items() if tokens]
        if d.chat_template not in named:
            raise ConfigError(f"data.add_special_tokens=true adds a named template's special tokens; set data.chat_template "
                              f"to one of {', '.join(named)} (now: {d.chat_template})")
    if d.max_seq_len < 16:
        raise ConfigError(f"data.max_seq_len={d.max_seq_len} is too small to hold a prompt and an answer (>= 16)")
    if not 0.0 <= d.eval_fraction < 1.0:
        raise ConfigError(f"data.eval_fraction={d.eval_fraction} must be in [0, 1)")
    if d.eval_fraction > 0 and d.eval_path:
        raise ConfigError("set data.eval_path or data.eval_fraction, not both")
    _positive("data.pad_to_multiple_of", d.pad_to_multiple_of)
    _choice("data.packed_attention", d.packed_attention, PACKED_ATTENTION_KERNELS)

    _positive("parallel.nproc_per_node", p.nproc_per_node)
    _positive("parallel.nnodes", p.nnodes)
    if not 0 <= p.node_rank < p.nnodes:
        raise ConfigError(f"parallel.node_rank={p.node_rank} must be in [0, parallel.nnodes={p.nnodes})")
    world = p.nproc_per_node * p.nnodes
    if p.name == "single" and world > 1:
        raise ConfigError(f"parallel=single runs one process, but nproc_per_node × nnodes = {world}; choose ddp, fsdp or zero1/2/3")
    from ftctl.parallel.mesh_shape import data_parallel_size
    from ftctl.parallel.support import mesh_refusal

    reason = mesh_refusal(cfg)  # before the batch check, which needs the mesh's data-parallel size
    if reason:
        raise ConfigError(reason)
    data_ranks = data_parallel_size(cfg, world)
    per_step = t.micro_batch_size * data_ranks
    if t.global_batch_size % per_step:
        ranks = "world size" if data_ranks == world else "data-parallel ranks (dp_replicate × dp_shard)"
        raise ConfigError(
            f"train.global_batch_size={t.global_batch_size} must be a multiple of "
            f"train.micro_batch_size × {ranks} = {t.micro_batch_size} × {data_ranks} = {per_step}"
        )
    _choice("parallel.dist_backend", p.dist_backend, ("auto", "gloo", "nccl"))
    if p.offload_optimizer not in (None, "cpu") or p.offload_params not in (None, "cpu"):
        raise ConfigError("parallel.offload_optimizer and parallel.offload_params take 'cpu' or null")
    from ftctl.parallel.support import config_refusal

    reason = config_refusal(cfg)
    if reason:
        raise ConfigError(reason)


def _check_objective(cfg: RunConfig) -> None:
    o, d = cfg.objective, cfg.data
    refuse_unknown_objective(f"objective.name={o.name}", o.name)
    _choice("objective.name", o.name, OBJECTIVES)
    _choice("objective.loss_type", o.loss_type, DPO_LOSS_TYPES)
    _positive("objective.beta", o.beta)
    for key in ("gamma", "orpo_lambda", "sft_weight"):
        _positive(f"objective.{key}", getattr(o, key), allow_zero=True)
    _positive("objective.desirable_weight", o.desirable_weight)
    _positive("objective.undesirable_weight", o.undesirable_weight)
    if not 0.0 <= o.label_smoothing < 0.5:
        raise ConfigError(f"objective.label_smoothing={o.label_smoothing} must be in [0, 0.5)")
    if o.label_smoothing and not (o.name == "simpo" or (o.name == "dpo" and o.loss_type in ("sigmoid", "robust"))):
        raise ConfigError(f"objective.label_smoothing={o.label_smoothing} applies to objective=dpo with loss_type sigmoid or "
                          "robust, and to simpo; set it to 0")
    if o.precompute_reference and o.name not in REFERENCE_OBJECTIVES:
        raise ConfigError(f"objective={o.name} has no reference model to precompute; objective.precompute_reference "
                          f"applies to {' and '.join(REFERENCE_OBJECTIVES)}")
    if o.sft_weight and o.name == "orpo":
        raise ConfigError("objective=orpo already trains the chosen answer's NLL (objective.orpo_lambda weighs the other term); "
                          "set objective.sft_weight=0")
    if o.name not in PREFERENCE_OBJECTIVES:
        return
    if cfg.parallel.name == "mesh":
        # A pipeline's schedule computes the token loss inside its last stage, and the pair log-probs have not
        # been proven against one process under tensor or expert splits.
        raise ConfigError(f"objective={o.name} does not run on parallel=mesh (tensor/pipeline/expert parallel) yet; "
                          "use parallel=fsdp or zero3 to shard a preference run")
    if d.mixture:
        raise ConfigError(f"objective={o.name} reads one preference source: set data.path (data.mixture is for SFT data)")
    if d.train_on_prompt:
        raise ConfigError(f"objective={o.name} compares answers to one prompt, so only answers train; set data.train_on_prompt=false")
    from data_formats import AUTO, get_format
    from ftctl.config.eval_sets import named_eval_sets

    named = [(f"data.eval_sets.{name}.format", entry.format) for name, entry in named_eval_sets(d.eval_sets).items()]
    for key, value in [("data.format", d.format), *named]:
        if value in (None, AUTO):  # auto: the format that reads the first record as preference data (one line if none does)
            continue
        fmt = get_format(value)
        if not (fmt.gives_pairs or (o.name == "kto" and fmt.gives_unpaired)):
            wanted = "preference, kto, alpaca or sharegpt" if o.name == "kto" else "preference, alpaca or sharegpt (with chosen and rejected)"
            raise ConfigError(f"objective={o.name} trains on preference data, which {key}={value} does not hold; use "
                              f"{key}={wanted} (or auto)")


def _check_run_length(t) -> None:
    """max_steps and epochs, warmup_steps and warmup_ratio: each pair says one thing two ways."""
    if t.max_steps is not None and t.epochs is not None:
        raise ConfigError(
            f"train.max_steps={t.max_steps} and train.epochs={t.epochs:g} are both set; keep one "
            "(train.max_steps=null to train by epochs, or train.epochs=null)"
        )
    if t.max_steps is not None:
        _positive("train.max_steps", t.max_steps)
    if t.epochs is not None:
        _positive("train.epochs", t.epochs)
    if not 0.0 <= t.warmup_ratio < 1.0:
        raise ConfigError(f"train.warmup_ratio={t.warmup_ratio} must be in [0, 1)")
    if t.warmup_ratio and t.warmup_steps:
        raise ConfigError(
            f"train.warmup_steps={t.warmup_steps} and train.warmup_ratio={t.warmup_ratio:g} are both set; keep one "
            "(the other =0)"
        )


def _check_training_options(t) -> None:
    """The schedule's, the optimizer's and the model-side options' own settings."""
    _positive("train.lr_cycles", t.lr_cycles)
    if not 0.0 < t.wsd_decay_ratio < 1.0:
        raise ConfigError(f"train.wsd_decay_ratio={t.wsd_decay_ratio} must be in (0, 1): the share of the steps in the final decay")
    _choice("train.wsd_decay_shape", t.wsd_decay_shape, WSD_DECAY_SHAPES)
    if t.optimizer == "schedule_free_adamw" and t.lr_scheduler != "constant":
        raise ConfigError(
            f"train.optimizer=schedule_free_adamw replaces the lr decay by averaging its iterates, and "
            f"train.lr_scheduler={t.lr_scheduler} would decay it too; set train.lr_scheduler=constant (warmup still applies)"
        )
    _positive("train.sgd_momentum", t.sgd_momentum, allow_zero=True)
    if t.sgd_nesterov and not t.sgd_momentum:
        raise ConfigError("train.sgd_nesterov=true needs momentum: set train.sgd_momentum (e.g. 0.9)")
    _positive("train.gradient_checkpointing_every", t.gradient_checkpointing_every)
    if t.gradient_checkpointing_every > 1 and not t.gradient_checkpointing:
        raise ConfigError(f"train.gradient_checkpointing_every={t.gradient_checkpointing_every} does nothing without "
                          f"train.gradient_checkpointing=true; set both")
    _positive("train.neftune_alpha", t.neftune_alpha, allow_zero=True)
    _choice("train.kernels", t.kernels, KERNELS)


def gradient_accumulation_steps(cfg: RunConfig, world_size: int) -> int:
    """global = micro × data-parallel ranks × accumulation, so a batch's result does not depend on how it is split.

    The data-parallel ranks are the world, except on a mesh, whose tensor- and pipeline-parallel ranks share their batch.
    """
    from ftctl.parallel.mesh_shape import data_parallel_size

    return cfg.train.global_batch_size // (cfg.train.micro_batch_size * data_parallel_size(cfg, world_size))
