"""Serving flags given to one command and forwarded to another's `flare run` (orbit's ranks, --hosts peers).

`forwarded(args)` spells, as `flare run` arguments, every serving flag (`run.add_serving_flags`) whose
parsed value is not its default: what the user typed, in a canonical spelling, so each rank parses
exactly it again.
"""

from __future__ import annotations

import argparse


def _serving_actions() -> list[argparse.Action]:
    from flare.cli.commands.run import add_serving_flags
    from flare.cli.framework import Parser

    parser = Parser(prog="flare run")
    add_serving_flags(parser)
    return [action for action in parser._actions if action.option_strings and action.dest != "help"]


def forwarded(args: argparse.Namespace) -> tuple[str, ...]:
    tokens: list[str] = []
    for action in _serving_actions():
        if not hasattr(args, action.dest):
            continue
        value = getattr(args, action.dest)
        if value == action.default:
            continue
        if action.nargs == 0:                        # store_true / store_false / store_const
            if value == action.const:
                tokens.append(action.option_strings[0])
            continue
        tokens.append(f"{action.option_strings[0]}={value}")
    return tuple(tokens)
