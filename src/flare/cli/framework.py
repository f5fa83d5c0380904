"""Shared command-line machinery for `ignition` and `flare` (spec sections 2 and 3.2).

Each command lives in its own module with two functions:
    configure(parser)  declares its arguments; must not import torch or read any file
    run(args) -> int   does the work; imports what it needs lazily
so that `--help` stays fast and never touches a package, a GPU or the configuration.

Conventions every command gets from here:
* exactly one name per command; `prog help CMD` is `prog CMD --help`;
* `-h`/`--help` anywhere on the line (before `--`), also after positionals and options, prints help
  and exits 0 without reading a file, probing a GPU or importing torch;
* options before or after positionals, `--opt VALUE` and `--opt=VALUE`, including values that
  start with a dash (`--memory-limit -30g`);
* usage errors on stderr with exit status 2; `FlareError`s print `error: ...` with their own status;
* `--config PATH` on every command. Before `run(args)` is called the configuration is loaded into
  `args.configuration` (a `flare.config.Config`) and `flare.environment.apply_library_environment`
  has set the variables libraries read, so `run` may import torch and huggingface_hub freely.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from flare.errors import FlareError

HELP_FLAGS = ("-h", "--help")


@dataclass(frozen=True)
class Command:
    name: str
    summary: str
    module: str
    epilog: Callable[[], str] | None = None     # text after the command's options in --help


class Parser(argparse.ArgumentParser):
    """argparse, with usage errors on stderr and exit status 2 (argparse's own convention), no
    abbreviated options, and dash-leading option values accepted in both spellings."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)

    def parse_known_args(self, args=None, namespace=None):
        args = list(sys.argv[1:] if args is None else args)
        return super().parse_known_args(self._join_dash_values(args), namespace)

    def _join_dash_values(self, args: list[str]) -> list[str]:
        """Rewrite `--opt -30g` as `--opt=-30g` when --opt takes one value and -30g is no option.

        argparse would otherwise read `-30g` as an unknown option; the spec accepts both spellings.
        """
        joined: list[str] = []
        index = 0
        while index < len(args):
            token = args[index]
            if token == "--":
                joined.extend(args[index:])
                break
            action = self._option_string_actions.get(token)
            following = args[index + 1] if index + 1 < len(args) else None
            if (action is not None and action.nargs is None and following is not None
                    and following.startswith("-") and following != "--"
                    and following.split("=", 1)[0] not in self._option_string_actions):
                joined.append(f"{token}={following}")
                index += 2
                continue
            joined.append(token)
            index += 1
        return joined


def add_config_argument(parser: argparse.ArgumentParser) -> None:
    """`--config PATH`: the configuration file (default ~/.config/flare/config.toml)."""
    parser.add_argument("--config", type=Path, default=None, metavar="PATH",
                        help="configuration file (default: ~/.config/flare/config.toml)")


def build_parser(prog: str, description: str, commands: Sequence[Command]) -> Parser:
    parser = Parser(prog=prog, description=description)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for command in commands:
        child = sub.add_parser(command.name, help=command.summary, description=command.summary)
        importlib.import_module(command.module).configure(child)
        if "--config" not in child._option_string_actions:
            add_config_argument(child)
        if command.epilog is not None and not child.epilog:
            child.epilog = command.epilog()
        child.set_defaults(_module=command.module)
    return parser


def wants_help(argv: Sequence[str]) -> bool:
    """Whether -h/--help appears before any `--` separator."""
    for token in argv:
        if token == "--":
            return False
        if token in HELP_FLAGS:
            return True
    return False


def _subcommands(parser: argparse.ArgumentParser) -> dict[str, argparse.ArgumentParser]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return action.choices
    return {}


def help_target(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.ArgumentParser | None:
    """The (sub)command parser whose help the line asks for, or None when the command is unknown."""
    current = parser
    for position, token in enumerate(argv):
        if token == "--":
            break
        choices = _subcommands(current)
        if not choices:
            break
        if token.startswith("-"):
            continue
        if token in choices:
            current = choices[token]
        elif current is parser and position == 0:
            return None                       # an unknown command: argparse reports it
    return current


def show_help(parser: Parser, argv: Sequence[str], help_hook: Callable[[list[str]], str | None] | None) -> int:
    target = help_target(parser, argv)
    if target is None:
        try:
            parser.parse_args(list(argv))     # prints the usage error for the unknown command
        except SystemExit as stop:
            return int(stop.code or 0)
        return 2
    extra = help_hook(list(argv)) if help_hook is not None and target is not parser else None
    if extra is not None:
        sys.stdout.write(target.format_usage() + "\n" + extra)
        return 0
    target.print_help()
    return 0


def run_cli(prog: str, description: str, commands: Sequence[Command], argv: Sequence[str] | None,
            epilog: str = "", help_hook: Callable[[list[str]], str | None] | None = None) -> int:
    """Parse `argv`, print help or run the chosen command; returns the exit status.

    `help_hook(argv)` may return extra help text for a line asking for help (recipe help); the
    command's usage line is printed above it instead of the full option list.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["help"]:                       # `flare help run` == `flare run --help`
        argv = argv[1:] + ["--help"]
    parser = build_parser(prog, description, commands)
    parser.epilog = epilog or None
    if wants_help(argv):
        return show_help(parser, argv, help_hook)
    try:
        args, extras = parser.parse_known_args(argv)
        if extras:                                 # reported with the command's own usage line
            (help_target(parser, argv) or parser).error(f"unrecognized arguments: {' '.join(extras)}")
    except SystemExit as stop:                     # a usage error (2)
        return int(stop.code or 0)
    if not getattr(args, "command", None):
        parser.print_help()
        return 0
    try:
        prepare_environment(args)
        module = importlib.import_module(args._module)
        return int(module.run(args) or 0)
    except FlareError as error:
        print(f"error: {error}", file=sys.stderr)
        return error.exit_code
    except KeyboardInterrupt:
        return 130


def prepare_environment(args: argparse.Namespace) -> None:
    """Load the configuration into `args.configuration` and set the library environment from it."""
    from flare.config import load_config
    from flare.environment import apply_library_environment

    args.configuration = load_config(getattr(args, "config", None))
    apply_library_environment(args.configuration)
