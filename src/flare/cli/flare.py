"""`flare`: serve and manage prepared runtime packages."""

from __future__ import annotations

from typing import Sequence

from flare.cli.framework import Command, run_cli

COMMANDS = (
    Command("run", "serve a prepared package over the OpenAI and Anthropic APIs", "flare.cli.commands.run"),
    Command("download", "download a prepared package into the model cache", "flare.cli.commands.download"),
    Command("inspect", "describe a prepared package", "flare.cli.commands.inspect"),
    Command("models", "manage the prepared-model cache", "flare.cli.commands.models"),
    Command("trust", "manage remembered publisher keys", "flare.cli.commands.trust"),
    Command("prefix-pool", "share retained prefix states between servers of one package",
            "flare.cli.commands.prefix_pool"),
    Command("agent", "run this host's rank agent, or install, pair or reset it", "flare.cli.commands.agent"),
    Command("orbit", "drive ranks on paired hosts: pair, run, status, attach, stop, push, ...",
            "flare.cli.commands.orbit"),
)


def main(argv: Sequence[str] | None = None) -> int:
    return run_cli("flare", "Serve prepared models fast.", COMMANDS, argv)


if __name__ == "__main__":
    import sys

    sys.exit(main())
