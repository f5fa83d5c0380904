"""`ignition sign PACKAGE`: verify a development package and promote it with the publishing key."""

from __future__ import annotations

from pathlib import Path


def configure(parser):
    parser.add_argument("package", metavar="PACKAGE", help="cache entry, MODEL[@VERSION] or package path")
    parser.add_argument("--config", type=Path, metavar="PATH",
                        help="configuration file holding [publishing] (default ~/.config/flare/config.toml)")
    parser.add_argument("--official-source", metavar="URL", help="overrides [publishing] official_source")
    parser.add_argument("--repo-id", metavar="NAMESPACE/REPOSITORY", help="Hugging Face target to record")
    parser.add_argument("--publisher-keys", action="append", type=Path, default=[], metavar="PATH",
                        help="profile verifying the development package (default: the development profile)")


def run(args) -> int:
    from flare.package.keys import sign_package
    print(sign_package(args.package, args.config, args.official_source, args.repo_id,
                       tuple(args.publisher_keys)))
    return 0
