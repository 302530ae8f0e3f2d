"""The `ftctl` command line. Imports stay light here: torch loads only for commands that train or run a model."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import List, Optional

from ftctl.errors import FtctlError

log = logging.getLogger("ftctl")

USAGE = """ftctl <command> [key=value ...]

commands:
  train          fine-tune: ftctl train recipe=NAME [key=value ...] [--cfg] [--dry-run]
  recipes        list the recipe presets
  models         list the built-in model aliases
  config-docs    every config key with its type, default and meaning
  data preview   show rendered examples with trained spans marked: ftctl data preview recipe=NAME n=3
"""


def setup_logging(run_dir=None, debug: bool = False) -> None:
    logger = logging.getLogger("ftctl")
    logger.setLevel(logging.DEBUG if debug else logging.INFO)
    logger.propagate = False
    if not any(isinstance(h, logging.StreamHandler) and getattr(h, "_ftctl", False) for h in logger.handlers):
        handler = logging.StreamHandler(sys.stdout)
        handler.setFormatter(logging.Formatter("[ftctl] %(message)s"))
        handler._ftctl = True
        logger.addHandler(handler)
    if run_dir is not None:
        file_handler = logging.FileHandler(run_dir / "train.log")
        file_handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(message)s"))
        logger.addHandler(file_handler)


def _split_extra(overrides: List[str], *names: str):
    """Pull command options such as n=3 out of the config overrides."""
    extra, rest = {}, []
    for item in overrides:
        key, _, value = item.partition("=")
        (extra.__setitem__(key, value) if key in names else rest.append(item))
    return extra, rest


def cmd_train(args) -> int:
    from ftctl.config.compose import compose_config, to_yaml

    cfg = compose_config(args.overrides)
    if args.cfg:
        print(to_yaml(cfg), end="")
        return 0
    if args.dry_run:
        print(to_yaml(cfg), end="")
        print(f"# dry run: config valid; training would write to {cfg.output_dir}")
        return 0
    from ftctl.training.run_dir import prepare_run_dir

    run_dir = prepare_run_dir(cfg)
    setup_logging(run_dir, args.debug)
    log.info("run dir %s (resolved config in config.yaml)", run_dir)
    from ftctl.training.runner import train

    result = train(cfg, run_dir)
    eval_part = f", eval loss {result.last_eval_loss:.4f}" if result.last_eval_loss is not None else ""
    print(f"done: {result.steps} steps, final loss {result.last_loss:.4f}{eval_part} -> {result.final_dir}")
    return 0


def cmd_recipes(args) -> int:
    from ftctl.config.compose import list_recipes

    rows = list_recipes()
    width = max(len(r["name"]) for r in rows)
    for r in rows:
        print(f"{r['name']:<{width}}  {r['description']}")
    return 0


def cmd_models(args) -> int:
    from ftctl.models.aliases import aliases

    for name, description in sorted(aliases().items()):
        print(f"{name:<24}  {description}")
    return 0


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
    cfg = compose_config(overrides)
    from ftctl.data.preview import preview

    preview(cfg, int(extra.get("n", 3)), color=sys.stdout.isatty())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ftctl", usage=USAGE, description="Configuration-driven LLM fine-tuning.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", metavar="command")

    train = sub.add_parser("train", help="fine-tune a model", description="ftctl train recipe=NAME [key=value ...]")
    train.add_argument("overrides", nargs="*", help="config overrides, key=value")
    train.add_argument("--cfg", action="store_true", help="print the resolved config and exit")
    train.add_argument("--dry-run", action="store_true", help="validate and resolve, print the plan, do not train")
    train.set_defaults(func=cmd_train)

    sub.add_parser("recipes", help="list recipe presets").set_defaults(func=cmd_recipes)
    sub.add_parser("models", help="list built-in model aliases").set_defaults(func=cmd_models)
    sub.add_parser("config-docs", help="document every config key").set_defaults(func=cmd_config_docs)

    data = sub.add_parser("data", help="inspect training data")
    data_sub = data.add_subparsers(dest="data_command", metavar="subcommand")
    prev = data_sub.add_parser("preview", help="rendered examples with trained spans marked")
    prev.add_argument("overrides", nargs="*")
    prev.set_defaults(func=cmd_data_preview)
    for p in sub.choices.values():
        p.add_argument("--debug", action="store_true", default=argparse.SUPPRESS, help="show tracebacks")
    prev.add_argument("--debug", action="store_true", default=argparse.SUPPRESS)
    return parser


def main(argv: Optional[List[str]] = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    args.debug = getattr(args, "debug", False)
    if not getattr(args, "func", None):
        parser.print_help()
        return 0 if args.command is None else 2
    setup_logging(debug=args.debug)
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


if __name__ == "__main__":
    sys.exit(main())
