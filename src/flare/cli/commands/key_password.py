"""`ignition key-password KEY`: change a signing key's passphrase, keeping its identity."""

from __future__ import annotations

from pathlib import Path


def configure(parser):
    parser.add_argument("key", type=Path, metavar="KEY_PATH", help="the encrypted signing key")
    parser.add_argument("--old-passphrase-file", type=Path, metavar="PATH",
                        help="read the current passphrase from this file")
    parser.add_argument("--new-passphrase-file", type=Path, metavar="PATH",
                        help="read the new passphrase from this file")


def run(args) -> int:
    from flare.package.keys import change_passphrase
    fingerprint = change_passphrase(args.key, args.old_passphrase_file, args.new_passphrase_file)
    print(f"passphrase changed; fingerprint unchanged: {fingerprint}")
    return 0
