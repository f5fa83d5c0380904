"""`ignition convert CACHE_ENTRY`: write a standalone packed file or directory of a package."""

from __future__ import annotations

from pathlib import Path


def configure(parser):
    parser.add_argument("package", metavar="CACHE_ENTRY", help="the entry path printed by `ignition export`, "
                        "or a packed package file")
    parser.add_argument("--form", choices=("packed", "directory"), default="directory",
                        help="packed: one file; directory: a primary plus payload files (default)")
    parser.add_argument("--output", type=Path, metavar="PATH",
                        help="destination; must not exist (default: MODEL-VERSION[.safetensors] here)")
    parser.add_argument("--publisher-keys", action="append", type=Path, default=[], metavar="PATH",
                        help="public publisher profile verifying a production package's signature")


def run(args) -> int:
    from flare.package.convert import convert
    from flare.package.trust import TrustOptions
    from flare.package import format as fmt
    trust = TrustOptions(publisher_keys=tuple(args.publisher_keys), require_acceptance=False)
    output = args.output
    if output is None:
        manifest = fmt.read_package_files(Path(args.package)).primary.manifest
        output = Path(f"{manifest.model_key}-{manifest.version}"
                      + (".safetensors" if args.form == "packed" else ""))
    print(convert(Path(args.package), output, args.form, trust))
    return 0
