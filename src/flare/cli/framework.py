"""Shared command-line machinery for `ignition` and `flare`.

Each command lives in its own module with two functions:
    configure(parser)  declares its arguments; must not import torch or read any file
    run(args) -> int   does the work; imports what it needs lazily
so that `--help` stays fast and never touches a package, a GPU or the configuration.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from dataclasses import dataclass
from typing import Sequence

from flare.errors import FlareError


@dataclass(frozen=True)
class Command:
    name: str
    summary: str
    module: str


class Parser(argparse.ArgumentParser):
    """argparse, with usage errors on stderr and exit status 2 (argparse's own convention)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        kwargs.setdefault("formatter_class", argparse.RawDescriptionHelpFormatter)
        super().__init__(*args, **kwargs)


def build_parser(prog: str, description: str, commands: Sequence[Command]) -> Parser:
    parser = Parser(prog=prog, description=description)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", parser_class=Parser)
    for command in commands:
        child = sub.add_parser(command.name, help=command.summary, description=command.summary)
        importlib.import_module(command.module).configure(child)
        child.set_defaults(_module=command.module)
    return parser


def run_cli(prog: str, description: str, commands: Sequence[Command], argv: Sequence[str] | None,
            epilog: str = "") -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["help"]:                       # `flare help run` == `flare run --help`
        argv = argv[1:] + ["--help"]
    parser = build_parser(prog, description, commands)
    parser.epilog = epilog or None
    try:
        args = parser.parse_args(argv)
    except SystemExit as stop:                     # --help (0) or a usage error (2)
        return int(stop.code or 0)
    if not getattr(args, "command", None):
        parser.print_help()
        return 0
    module = importlib.import_module(args._module)
    try:
        return int(module.run(args) or 0)
    except FlareError as error:
        print(f"error: {error}", file=sys.stderr)
        return error.exit_code
    except KeyboardInterrupt:
        return 130
