"""The `ftctl` command line. Imports stay light here: torch loads only for commands that train or run a model."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from pathlib import Path
from typing import List, Optional

from ftctl.console import done_line, quiet_libraries, setup_logging
from ftctl.errors import FtctlError, did_you_mean
from ftctl.options import bool_option

log = logging.getLogger("ftctl")

USAGE = """ftctl <command> [key=value ...]

commands:
  train          fine-tune: ftctl train recipe=NAME|--config FILE [key=value ...] [--cfg] [--dry-run]
  recipes        list the recipe presets: ftctl recipes [show NAME | cp NAME FILE]
  estimate       memory per rank by part: ftctl estimate recipe=NAME [key=value ...] [--json]
  models         list the built-in model aliases: ftctl models [--prepare NAME | --rebuild NAME]
  eval           score held-out data or harness tasks (preference pairs: reward accuracy): ftctl eval model=NAME data.path=SOURCE [adapter=DIR] [metric=M] [harness=TASK]
  config-docs    every config key with its type, default and meaning
  data preview   show rendered examples with trained spans marked: ftctl data preview recipe=NAME n=3
  merge          fold an adapter into its base: ftctl merge adapter=DIR output=DIR [base=DIR] [dtype=float32]
  export         write a result as a transformers dir or a GGUF file: ftctl export model=RUN_DIR format=hf|gguf output=PATH
  chat           talk to a model: ftctl chat model=NAME_OR_DIR_OR_GGUF [adapter=DIR] [prompt="..."]
  generate       answer a file of prompts: ftctl generate model=NAME input=FILE output=FILE.jsonl
  plot           draw a run's loss curve: ftctl plot RUN_DIR [output=FILE.png]
  push           upload a result with a model card to the Hugging Face Hub: ftctl push RUN_OR_RESULT REPO_ID [private=true]
"""


def _split_extra(overrides: List[str], *names: str):
    """Pull command options such as n=3 out of the config overrides."""
    extra, rest = {}, []
    for item in overrides:
        key, _, value = item.partition("=")
        (extra.__setitem__(key, value) if key in names else rest.append(item))
    return extra, rest


def cmd_train(args) -> int:
    from ftctl.config.compose import compose_config, to_yaml

    run_config = None if args.config else saved_run_config(args.overrides)
    # A run's own config.yaml holds paths as its command line gave them, relative to where ftctl ran.
    cfg = compose_config(args.overrides, args.config or run_config, paths_from_file=run_config is None)
    if args.cfg:
        print(to_yaml(cfg), end="")
        return 0
    from ftctl.preflight import check_files, check_launch, visible_device_type

    from ftctl.estimate import mesh_model_refusal

    if args.dry_run:  # the plan, and the checks a real run on this machine makes before it starts
        from ftctl.plan import describe_run

        print(describe_run(cfg), flush=True)
        # After the plan, which may be meant for another machine: what a run here would refuse.
        check_files(cfg, check_hub=False)
        check_launch(cfg, args.overrides, visible_device_type())
        _refuse(mesh_model_refusal(cfg))
        return 0
    check_files(cfg)  # before torch loads: a wrong path or an unreachable hub is a message within seconds
    check_launch(cfg, args.overrides)  # before anything is written or started
    _refuse(mesh_model_refusal(cfg))
    from ftctl.launch import launch_workers, world_size
    from ftctl.parallel.place import inside_launcher
    from ftctl.training.run_dir import prepare_run_dir

    if inside_launcher():  # torchrun, deepspeed or srun started this process once per rank
        from ftctl.worker import train_under_launcher

        result = train_under_launcher(cfg, args.debug)
        if result is not None:  # rank 0
            print(done_line(result))
        return 0
    if cfg.parallel.node_rank > 0:  # node 0 owns the run dir; this node only starts its own workers
        launch_workers(cfg, Path(cfg.output_dir).expanduser())
        return 0
    run_dir = prepare_run_dir(cfg)  # holds the run dir's lock from here until this process ends
    from ftctl.training.run_dir import end_failed_run, finish_run_dir

    try:
        setup_logging(run_dir, args.debug)
        from ftctl.training.runner import train

        if world_size(cfg) > 1:
            launch_workers(cfg, run_dir, run_dir / "config.yaml")  # rank 0 prints the result line
            return 0
        result = train(cfg, run_dir)
    except BaseException as exc:  # whatever stopped it, a run that never took a step leaves nothing behind
        end_failed_run(run_dir, exc)
        raise
    finally:
        finish_run_dir(run_dir)
    print(done_line(result))
    return 0


def _refuse(reason: Optional[str]) -> None:
    if reason:
        from ftctl.errors import ConfigError

        raise ConfigError(reason)


#: The keys most runs set, listed by `ftctl train --help` with their schema help (config-docs has them all).
MAIN_KEYS = (
    "model.name_or_path", "data.path", "data.format", "data.eval_path", "output_dir", "method.r", "train.max_steps",
    "train.lr", "train.lr_scheduler", "train.optimizer", "train.global_batch_size", "train.micro_batch_size", "train.report_to", "resume",
)


def train_help_epilog() -> str:
    """The config groups with their choices and the main keys; built only when help is asked for."""
    import textwrap

    from ftctl.config.compose import GROUPS, group_options, schema_fields

    fields = schema_fields()
    width = max(map(len, MAIN_KEYS)) + 2
    groups = [f"  {group:<10} {', '.join(group_options(group))}" for group in GROUPS]
    keys = [f"  {key:<{width}} {textwrap.shorten(fields[key].metadata.get('help', ''), 116 - width)}" for key in MAIN_KEYS if key in fields]
    return "\n".join([
        "config groups (GROUP=CHOICE; recipe= presets several):", *groups, "",
        "main keys (KEY=VALUE):", *keys, "",
        "every key with its type, default and meaning: ftctl config-docs",
        "examples:",
        "  ftctl train model.name_or_path=smollm2-135m-instruct data.path=my.jsonl output_dir=runs/mine",
        "  ftctl train recipe=tiny_lora method=qlora train.lr=1e-4 'train.report_to=[tensorboard,mlflow]'",
    ])


def cmd_estimate(args) -> int:
    from ftctl.config.compose import compose_config
    from ftctl.estimate import estimate_for, format_table, to_json

    estimate = estimate_for(compose_config(args.overrides, args.config, needs_data=False))
    print(to_json(estimate) if args.json else format_table(estimate))
    return 0


def saved_run_config(overrides: List[str]) -> Optional[str]:
    """`resume=auto output_dir=RUN` with no recipe or --config: the run's own config.yaml is the recipe."""
    values = dict(o.split("=", 1) for o in overrides if "=" in o)
    if "recipe" in values or not values.get("resume"):
        return None
    if values["resume"] != "auto":  # a checkpoint dir: RUN/checkpoints/step-N
        run_dir = Path(values["resume"]).expanduser().parent.parent
    elif "output_dir" in values:
        run_dir = Path(values["output_dir"]).expanduser()
    else:
        return None
    saved = run_dir / "config.yaml"
    if not saved.is_file():
        return None
    log.info("config: %s (the run's own; key=value arguments change it)", saved)
    return str(saved)


def cmd_recipes(args) -> int:
    from ftctl.config.compose import list_recipes, recipe_yaml

    if args.action:
        if not args.name:
            raise FtctlError(f"ftctl recipes {args.action} needs a recipe name (`ftctl recipes` lists them)")
        text = recipe_yaml(args.name)
        if args.action == "show":
            print(text, end="")
            return 0
        if not args.file:
            raise FtctlError(f"ftctl recipes cp {args.name} needs a file to write, for example my.yaml")
        from ftctl.paths import check_output_path, make_parent

        target = Path(args.file).expanduser()
        if target.exists():
            raise FtctlError(f"{target} exists; choose another file name, or delete it first")
        check_output_path(target, "FILE")
        make_parent(target, "FILE").write_text(text)
        print(f"copied recipe {args.name} to {target}; edit it, then: ftctl train --config {target}")
        return 0
    rows = list_recipes()
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        print(f"{r['name']:<{width}}  {r['description']}")
    return 0


def cmd_models(args) -> int:
    from ftctl.models.aliases import alias_dir, aliases, resolve_alias

    name = args.prepare or args.rebuild
    if name:
        if name not in aliases():
            raise FtctlError(f"unknown model alias '{name}'.{did_you_mean(name, aliases())} Aliases: {', '.join(sorted(aliases()))}")
        print(resolve_alias(name, rebuild=bool(args.rebuild)))
        return 0
    for name, description in sorted(aliases().items()):
        state = "ready" if alias_dir(name).is_dir() else "built on first use"
        print(f"{name:<24}  {description} [{state}]")
    return 0


def cmd_eval(args) -> int:
    from ftctl.evaluation.evaluate import request_from_overrides

    request = request_from_overrides(args.overrides, args.config)
    from ftctl.evaluation.preference import describe, is_preference_eval, run_preference_eval

    if is_preference_eval(request.data_path, request.data_format):  # pairs: reward accuracy, not generation
        summary = run_preference_eval(request)
        print(f"{describe(summary)} -> {request.output}/eval.json")
        return 0
    from ftctl.evaluation.evaluate import run_eval

    result = run_eval(request)
    sets = {None: result} if "metrics" in result else result.get("sets", {})
    for name, summary in sets.items():
        print(f"eval{' ' + name if name else ''}: {_scores_line(summary)} -> {request.output}/eval.json")
    for task, scores in result.get("harness", {}).items():
        print(f"eval harness {task}: " + ", ".join(f"{k} {v:.4g}" for k, v in scores.items() if "stderr" not in k and k != "sample_len"))
    return 0


def _scores_line(summary: dict) -> str:
    """'json_match 0.960 (48/50), rouge_l 0.981, perplexity 1.52' for one set's summary."""
    parts = []
    for metric, value in summary["metrics"].items():
        if metric == "perplexity":
            parts.append(f"perplexity {value:.4g} ({summary['perplexity']['tokens']} tokens)")
        elif "correct" in summary and not parts:
            parts.append(f"{metric} {value:.3f} ({summary['correct']}/{summary['n']})")
        else:
            parts.append(f"{metric} {value:.3f}")
    return ", ".join(parts)


def cmd_config_docs(args) -> int:
    import dataclasses

    from ftctl.config.compose import schema_fields

    for key, f in schema_fields().items():
        default = f.default if f.default_factory is dataclasses.MISSING else f.default_factory()
        print(f"{key:<30} {f.type:<14} {default!r:<16} {f.metadata.get('help', '')}")
    return 0


def cmd_data_preview(args) -> int:
    from ftctl.config.compose import compose_config

    extra, overrides = _split_extra(args.overrides, "n")
    cfg = compose_config(overrides, args.config)
    from ftctl.data.preview import preview

    preview(cfg, int(extra.get("n", 3)), color=sys.stdout.isatty())
    return 0


MERGE_KEYS = {
    "adapter": "a run's final/ or checkpoints/step-N/ adapter dir (required)",
    "output": "where to write the merged model dir (required)",
    "base": "base model dir or alias; default: the one named in the adapter's adapter_config.json",
    "dtype": "float32 (default), bfloat16 or float16",
    "overwrite": "true to replace a non-empty output dir",
    "dequantize": "QLoRA adapters: true (default) merges into the dequantised 4-bit base they trained on, false into the original weights",
}


def parse_key_values(items: List[str], keys: dict, command: str, example: str) -> dict:
    """`ftctl COMMAND key=value ...` arguments as a dict; a malformed item or unknown key is one clear error."""
    from ftctl.errors import did_you_mean

    options = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or not value:
            raise FtctlError(f"cannot read '{item}': write key=value, for example {example}")
        if key not in keys:
            raise FtctlError(f"unknown {command} option '{key}'.{did_you_mean(key, keys)} Options: {', '.join(keys)}")
        options[key] = value
    return options


def parse_merge_args(items: List[str]) -> dict:
    """adapter=DIR output=DIR [base=DIR] [dtype=...] [overwrite=...] [dequantize=...] as keyword arguments."""
    options = parse_key_values(items, MERGE_KEYS, "merge", "adapter=runs/x/final")
    missing = [key for key in ("adapter", "output") if key not in options]
    if missing:
        raise FtctlError(f"merge needs {' and '.join(k + '=DIR' for k in missing)}: ftctl merge adapter=DIR output=DIR [base=DIR] [dtype=float32]")
    for key in ("overwrite", "dequantize"):
        if key in options:
            options[key] = bool_option(key, options[key])
    return options


def cmd_merge(args) -> int:
    options = parse_merge_args(args.options)
    from ftctl.merging import merge

    adapter, output = options.pop("adapter"), options.pop("output")
    written = merge(adapter, output, **options)
    print(f"merged {adapter} -> {written}")
    return 0


def cmd_export(args) -> int:
    from ftctl.export import EXPORT_OPTIONS, export_model, request_from_options

    request = request_from_options(parse_key_values(args.options, EXPORT_OPTIONS, "export", "format=gguf"))
    written = export_model(request)
    print(f"exported {request.model} -> {written}")
    return 0


def cmd_chat(args) -> int:
    from ftctl.chat import CHAT_OPTIONS, run_chat

    options = parse_key_values(args.options, CHAT_OPTIONS, "chat", "model=runs/x")
    logger = logging.getLogger("ftctl")
    level = logger.level
    if not args.debug:  # progress lines would mix with the answers on stdout
        logger.setLevel(logging.WARNING)
    try:
        return run_chat(options)
    finally:
        logger.setLevel(level)


def cmd_generate(args) -> int:
    from ftctl.chat import GENERATE_OPTIONS, run_generate

    summary = run_generate(parse_key_values(args.options, GENERATE_OPTIONS, "generate", "input=prompts.jsonl"))
    print(f"generated {summary['n']} answers -> {summary['output']}")
    return 0


PLOT_KEYS = {"output": "the image to write; default RUN_DIR/loss_curve.png"}


def cmd_plot(args) -> int:
    from ftctl.training.plot import can_plot, draw_loss_curve

    options = parse_key_values(args.options, PLOT_KEYS, "plot", "output=curve.png")
    if not Path(args.run_dir, "metrics.jsonl").is_file():
        raise FtctlError(f"{args.run_dir}: no metrics.jsonl here; pass the output_dir of a training run")
    if not can_plot():
        raise FtctlError("plotting needs matplotlib: pip install 'ftctl[plot]'")
    if "output" in options:
        from ftctl.paths import check_output_path

        check_output_path(Path(options["output"]), "output")
    print(f"plotted {args.run_dir} -> {draw_loss_curve(args.run_dir, options.get('output'))}")
    return 0


def cmd_push(args) -> int:
    from ftctl.push import PUSH_OPTIONS, push

    options = parse_key_values(args.options, PUSH_OPTIONS, "push", "private=true")
    print(push(args.target, args.repo_id, options))
    return 0


def _key_value_command(sub, name: str, help_text: str, usage: str, keys: dict, func) -> None:
    width = max(len(key) for key in keys) + 2
    keys_help = "\n".join(f"  {key:<{width}} {text}" for key, text in keys.items())
    command = sub.add_parser(
        name, prog=f"ftctl {name}", help=help_text, formatter_class=argparse.RawDescriptionHelpFormatter,
        description=f"{usage}\n\nkeys:\n{keys_help}",
    )
    command.add_argument("options", nargs="*", help="key=value")
    command.set_defaults(func=func)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ftctl", usage=USAGE, description="Configuration-driven LLM fine-tuning.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    # The deepspeed launcher inserts --local_rank=N right after the program; the rank is read from LOCAL_RANK.
    parser.add_argument("--local_rank", "--local-rank", type=int, help=argparse.SUPPRESS)
    sub = parser.add_subparsers(dest="command", metavar="command")

    train = sub.add_parser("train", help="fine-tune a model", description="ftctl train recipe=NAME [key=value ...]",
                           formatter_class=argparse.RawDescriptionHelpFormatter)
    # Reading the recipe tree and the schema costs start-up time every other command would pay: only on --help.
    train.format_help = lambda: argparse.ArgumentParser.format_help(train) + "\n" + train_help_epilog() + "\n"
    train.add_argument("overrides", nargs="*", help="config overrides, key=value")
    train.add_argument("--config", metavar="FILE", help="a recipe file from anywhere (`ftctl recipes cp NAME FILE` makes one); key=value arguments still win")
    train.add_argument("--cfg", action="store_true", help="print the resolved config and exit")
    train.add_argument("--dry-run", action="store_true", help="validate and resolve, print the plan, do not train")
    train.set_defaults(func=cmd_train)

    recipes = sub.add_parser(
        "recipes", help="list recipe presets; show or copy one", description="ftctl recipes | ftctl recipes show NAME | ftctl recipes cp NAME FILE"
    )
    recipes.add_argument("action", nargs="?", choices=("show", "cp"), help="show: print the preset's full config as YAML; cp: copy it to FILE to edit")
    recipes.add_argument("name", nargs="?", help="recipe name (`ftctl recipes` lists them)")
    recipes.add_argument("file", nargs="?", help="cp: the file to write; train it with ftctl train --config FILE")
    recipes.set_defaults(func=cmd_recipes)
    estimate = sub.add_parser(
        "estimate", help="per-rank memory of a run by part, from the model config alone",
        description="ftctl estimate recipe=NAME [key=value ...] [--json]: weights, gradients, optimizer states, "
        "activations (with and without checkpointing) and total per rank, for the run's method, backend, "
        "precision and world size. No weights are loaded.",
    )
    estimate.add_argument("overrides", nargs="*", help="config overrides, key=value (as for train)")
    estimate.add_argument("--json", action="store_true", help="print a JSON object (weights_bytes, ..., total_bytes)")
    estimate.add_argument("--config", metavar="FILE", help="a recipe file from anywhere, as for train")
    estimate.set_defaults(func=cmd_estimate)
    models = sub.add_parser("models", prog="ftctl models", help="list built-in model aliases", description="ftctl models [--prepare NAME | --rebuild NAME]")
    models.add_argument("--prepare", metavar="NAME", help="build or convert the alias's model now (once) and print its dir")
    models.add_argument("--rebuild", metavar="NAME", help="rebuild the alias's cached model dir, e.g. after a corrupt cache")
    models.set_defaults(func=cmd_models)
    from ftctl.evaluation.evaluate import EVAL_OPTIONS

    eval_help = "\n".join(f"  {key:<19} {text}" for key, text in EVAL_OPTIONS.items())
    evaluate = sub.add_parser(
        "eval", prog="ftctl eval", help="generate on held-out data and score it", formatter_class=argparse.RawDescriptionHelpFormatter,
        description=f"ftctl eval model=NAME data.path=SOURCE [adapter=DIR] [key=value ...]\n\nkeys:\n{eval_help}",
    )
    evaluate.add_argument("overrides", nargs="*", help="key=value")
    evaluate.add_argument("--config", metavar="FILE", help="take the model and the data keys (data.eval_path, data.eval_sets) from a config file")
    evaluate.set_defaults(func=cmd_eval)
    sub.add_parser("config-docs", help="document every config key").set_defaults(func=cmd_config_docs)
    merge_help = "\n".join(f"  {key:<11} {text}" for key, text in MERGE_KEYS.items())
    merge = sub.add_parser(
        "merge", help="merge a LoRA/DoRA/QLoRA adapter into its base", formatter_class=argparse.RawDescriptionHelpFormatter,
        description=f"ftctl merge adapter=DIR output=DIR [key=value ...]\n\nkeys:\n{merge_help}",
    )
    merge.add_argument("options", nargs="*", help="key=value")
    merge.set_defaults(func=cmd_merge)
    from ftctl.chat import CHAT_OPTIONS, GENERATE_OPTIONS
    from ftctl.export import EXPORT_OPTIONS

    _key_value_command(sub, "export", "write a result as a transformers dir or one GGUF file",
                       "ftctl export model=RUN_OR_MODEL_DIR format=hf|gguf output=PATH [key=value ...]", EXPORT_OPTIONS, cmd_export)
    _key_value_command(sub, "chat", "chat with a model (stdin, or one prompt=)",
                       "ftctl chat model=NAME_OR_DIR_OR_GGUF [adapter=DIR] [prompt=TEXT] [key=value ...]\n\n"
                       "Reads one message per line until EOF or /exit; /reset starts a new conversation.", CHAT_OPTIONS, cmd_chat)
    _key_value_command(sub, "generate", "answer every prompt of a file into a jsonl file",
                       "ftctl generate model=NAME_OR_DIR_OR_GGUF input=FILE output=FILE.jsonl [key=value ...]", GENERATE_OPTIONS, cmd_generate)

    plot = sub.add_parser("plot", help="draw a run's loss curve into RUN_DIR/loss_curve.png",
                          description="ftctl plot RUN_DIR [output=FILE.png]: train and eval loss from RUN_DIR/metrics.jsonl (needs matplotlib)")
    plot.add_argument("run_dir", metavar="RUN_DIR", help="a training run's output_dir")
    plot.add_argument("options", nargs="*", help="output=FILE.png")
    plot.set_defaults(func=cmd_plot)

    from ftctl.push import PUSH_OPTIONS

    push_help = "\n".join(f"  {key:<15} {text}" for key, text in PUSH_OPTIONS.items())
    push = sub.add_parser(
        "push", help="upload a result with a generated model card to the Hugging Face Hub", formatter_class=argparse.RawDescriptionHelpFormatter,
        description="ftctl push RUN_OR_RESULT REPO_ID [key=value ...]: a run dir (its final/), a final/ or checkpoints/step-N/ dir, "
        "or a merged/exported result with run=RUN_DIR, uploaded with a README.md model card (base model, method, data, "
        f"final metrics, loss curve, resolved config). Log in first: hf auth login (or set HF_TOKEN).\n\nkeys:\n{push_help}",
    )
    push.add_argument("target", metavar="RUN_OR_RESULT", help="a run dir, its final/ or a checkpoint dir, or a merged/exported result")
    push.add_argument("repo_id", metavar="REPO_ID", help="the Hub model repo, ORG/NAME or NAME")
    push.add_argument("options", nargs="*", help="key=value")
    push.set_defaults(func=cmd_push)

    data = sub.add_parser("data", help="inspect training data")
    data_sub = data.add_subparsers(dest="data_command", metavar="subcommand")
    prev = data_sub.add_parser("preview", help="rendered examples with trained spans marked")
    prev.add_argument("overrides", nargs="*")
    prev.add_argument("--config", metavar="FILE", help="a recipe file from anywhere, as for train")
    prev.set_defaults(func=cmd_data_preview)
    for name, p in sub.choices.items():
        p.prog = f"ftctl {name}"  # not the top-level usage, which argparse would put in front of every one
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
        p.add_argument("--no-progress", action="store_true", default=argparse.SUPPRESS, help="no progress bars (also FTCTL_PROGRESS=0)")
    prev.prog = "ftctl data preview"
    prev.add_argument("--debug", action="store_true", default=argparse.SUPPRESS)
    prev.add_argument("--no-progress", action="store_true", default=argparse.SUPPRESS)
    parser.command_parsers = {**sub.choices, "data preview": prev}
    return parser


def _refuse_unknown_arguments(parser: argparse.ArgumentParser, args, unknown: List[str]) -> None:
    """argparse would answer with the top-level usage; say it in the command's own terms instead."""
    name = " ".join(filter(None, [args.command, getattr(args, "data_command", None)]))
    owner = parser.command_parsers.get(name, parser)
    flags = [flag for action in owner._actions for flag in action.option_strings if flag.startswith("--")]
    # Flags share their "--", so only a close match is a suggestion (--nope is not --help).
    hints = [did_you_mean(arg.split("=")[0], flags, cutoff=0.7).strip() for arg in unknown if arg.startswith("-")]
    owner.error(f"unrecognized arguments: {' '.join(unknown)}{''.join(' ' + h for h in hints if h)}")


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        _refuse_unknown_arguments(parser, args, unknown)
    args.debug = getattr(args, "debug", False)
    if getattr(args, "no_progress", False):
        os.environ["FTCTL_PROGRESS"] = "0"  # an environment variable, so that worker processes see it too
    if not getattr(args, "func", None):  # no command, or a command group without its subcommand (`ftctl data`)
        parser.command_parsers.get(args.command, parser).print_help()
        return 0 if args.command is None else 2
    setup_logging(debug=args.debug)
    quiet_libraries(args.debug)
    try:
        return args.func(args)
    except FtctlError as exc:
        if args.debug:
            raise
        print(f"ftctl: error: {exc}", file=sys.stderr)
        return exc.exit_code
    except KeyboardInterrupt:
        print("ftctl: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        if not _stdout_reader_gone():
            raise  # some other pipe: a real failure
        # The reader of our output went away (`ftctl config-docs | head`): stop quietly, as other tools do.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so the exit-time flush cannot fail again
        return 0
    except OSError as exc:  # a fault of the machine (full disk, lost mount, ...) that no writer named on its way up
        from ftctl.fs_faults import os_error_line

        line = os_error_line(exc)
        if line is None or args.debug:
            raise
        print(f"ftctl: error: {line}", file=sys.stderr)
        return 1


def _stdout_reader_gone() -> bool:
    import select

    try:
        poller = select.poll()
        poller.register(sys.stdout.fileno(), select.POLLOUT)
        return any(events & select.POLLERR for _, events in poller.poll(0))
    except (AttributeError, OSError, ValueError):  # no poll() here, or no real stdout
        return False


if __name__ == "__main__":
    sys.exit(main())
