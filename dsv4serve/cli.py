"""`dsv4serve`: serve / plan / doctor. The flags are built from the config's option declarations.

dsv4serve --model MODEL [options]          # same as: dsv4serve serve --model MODEL
dsv4serve plan  --model MODEL [options]    # memory plan only: reads config.json, loads no weights
dsv4serve doctor                           # environment report
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Any

from dsv4serve import __version__
from dsv4serve.config import ConfigError, options
from dsv4serve.env import Environment, option_env_name, read_environment
from dsv4serve.resolve_cli import resolve_from_cli

SUBCOMMANDS = ("serve", "plan", "doctor")
log = logging.getLogger("dsv4serve")


def _add_serve_options(parser: argparse.ArgumentParser) -> None:
    for name, opt in options().items():
        kwargs: dict[str, Any] = {  # argparse's keyword arguments, of several types
            "dest": name,
            "default": None,
            "help": f"{opt.help} (env {option_env_name(name)})",
            "metavar": opt.metavar,
        }
        if opt.switch:
            kwargs.update(action="store_const", const=True)
            del kwargs["metavar"]
        elif opt.choices:
            kwargs["choices"] = opt.choices
            kwargs["type"] = str
        else:
            kwargs["type"] = _argparse_type(opt.parse)
        parser.add_argument(opt.flag(name), **kwargs)
    parser.add_argument("--version", action="version", version=f"dsv4serve {__version__}")


def _argparse_type(parse):  # argparse reports ValueError/TypeError messages as "invalid value"
    def convert(text: str):
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from exc

    convert.__name__ = parse.__name__
    return convert


def build_parser(command: str) -> argparse.ArgumentParser:
    if command == "doctor":
        from dsv4serve.doctor import add_doctor_options

        parser = argparse.ArgumentParser(
            prog="dsv4serve doctor",
            description="environment report: what the server will run on, each line OK or what to fix",
        )
        add_doctor_options(parser)
        return parser
    prog = "dsv4serve" if command == "serve" else f"dsv4serve {command}"
    desc = (
        "Serve DeepSeek-V4 behind an OpenAI-style API. Subcommands: serve (default), plan, doctor."
        if command == "serve"
        else "Print the memory plan the server would use: reads config.json, loads no weights, needs no GPU."
    )
    parser = argparse.ArgumentParser(prog=prog, description=desc)
    _add_serve_options(parser)
    if command == "plan":
        from dsv4serve.plan_cli import add_plan_options

        add_plan_options(parser)
    return parser


def _split_command(argv: Sequence[str]) -> tuple[str, list[str]]:
    if argv and argv[0] in SUBCOMMANDS:
        return argv[0], list(argv[1:])
    return "serve", list(argv)


def _serve(ns: argparse.Namespace, env: Environment) -> int:
    from dsv4serve.report import format_settings

    cfg, location, args = resolve_from_cli(ns, env, config_only=False)
    logging.getLogger().setLevel(cfg.log_level.value.upper())
    print(format_settings(cfg), file=sys.stderr)
    log.info(
        "model %s at %s (%s): %d layers + %d MTP, checkpoint validated",
        location.name,
        location.path,
        location.origin,
        args.n_layers,
        args.n_mtp_layers,
    )
    from dsv4serve.api.server import serve

    return serve(cfg, location.path)


def main(argv: Sequence[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    command, rest = _split_command(sys.argv[1:] if argv is None else argv)
    ns = build_parser(command).parse_args(rest)
    from dsv4serve.checkpoint.source import CheckpointError
    from dsv4serve.model.args import ModelConfigError
    from dsv4serve.model_source import ModelSourceError

    try:
        env = read_environment(option_names=tuple(options()))
        if command == "doctor":
            from dsv4serve.doctor import run_doctor

            return run_doctor(ns, env)
        if command == "plan":
            from dsv4serve.plan_cli import run_plan

            return run_plan(ns, env)
        return _serve(ns, env)
    except (ConfigError, ModelSourceError, CheckpointError, ModelConfigError) as exc:
        print(f"dsv4serve: error: {exc}", file=sys.stderr)
        return 2
