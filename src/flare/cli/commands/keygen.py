"""`ignition keygen`: create an encrypted publisher signing key and its public profile."""

from __future__ import annotations

from pathlib import Path


def configure(parser):
    parser.add_argument("--namespace", required=True, help="publisher namespace, e.g. your Hugging Face user")
    parser.add_argument("--official-source", required=True, metavar="URL",
                        help="repository URL whose root will hold publisher.json")
    parser.add_argument("--output", type=Path, required=True, metavar="KEY_PATH",
                        help="where to write the encrypted PKCS#8 key; publisher.json is written beside it")
    parser.add_argument("--passphrase-file", type=Path, metavar="PATH",
                        help="read the passphrase from this file instead of asking on the terminal")


def run(args) -> int:
    from flare.package.keys import keygen
    key_path, profile_path, fingerprint = keygen(args.output, args.namespace, args.official_source,
                                                 args.passphrase_file)
    print(f"signing key: {key_path}")
    print(f"public profile: {profile_path}  (publish it as publisher.json at the root of "
          f"{args.official_source})")
    print(f"fingerprint: {fingerprint}")
    return 0
