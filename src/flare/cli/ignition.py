"""`ignition`: prepare models into signed runtime packages."""

from __future__ import annotations

from typing import Sequence

from flare.cli.framework import Command, run_cli


def _aliases_epilog() -> str:
    from flare.cli.recipe_help import aliases_epilog    # reads recipe declarations only

    return aliases_epilog()


COMMANDS = (
    Command("export", "prepare a model and publish it in the shared model cache", "flare.cli.commands.export",
            epilog=_aliases_epilog),
    Command("debug-serve", "prepare and serve in one process, without writing a package",
            "flare.cli.commands.debug_serve", epilog=_aliases_epilog),
    Command("bench", "measure the prepared decode step's GPU latency", "flare.cli.commands.bench",
            epilog=_aliases_epilog),
    Command("convert", "convert a cache entry to a standalone packed file or directory",
            "flare.cli.commands.convert"),
    Command("keygen", "create an encrypted publisher signing key and its public profile",
            "flare.cli.commands.keygen"),
    Command("key-password", "change a signing key's passphrase, keeping its identity",
            "flare.cli.commands.key_password"),
    Command("sign", "verify a development package and promote it with the publishing key",
            "flare.cli.commands.sign"),
)


def main(argv: Sequence[str] | None = None) -> int:
    from flare.cli.recipe_help import recipe_help

    return run_cli("ignition", "Prepare a model once into a signed, content-addressed runtime package.",
                   COMMANDS, argv, epilog=_aliases_epilog(), help_hook=recipe_help)
