"""`flare inspect PACKAGE|MODEL[@VERSION]`: describe a prepared package (shared with `flare models inspect`)."""

from __future__ import annotations

from pathlib import Path


def configure(parser):
    parser.add_argument("package", metavar="PACKAGE|MODEL[@VERSION]",
                        help="package path, or a model in the cache (its selected version unless @VERSION)")
    parser.add_argument("--tensor-parallel", type=int, metavar="N", help="select the deployment of this TP size")
    parser.add_argument("--rank", type=int, metavar="N", help="select one rank")
    parser.add_argument("--memory-map", action="store_true", help="payload locations and sizing formulas")
    parser.add_argument("--graphs", action="store_true", help="captured graph catalog per rank")
    parser.add_argument("--frontend", action="store_true", help="tokenizer, templates and frontend assets")
    parser.add_argument("--all", action="store_true", help="every section; JSON adds the complete manifest")
    output = parser.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="JSON with exact integers and nulls kept")
    output.add_argument("--plain", action="store_true", help="no terminal styling")
    parser.add_argument("--unverified", action="store_true",
                        help="read only the primary's metadata: no key, no signature check, no companion files")
    parser.add_argument("--publisher-keys", action="append", type=Path, default=[], metavar="PATH",
                        help="additional publisher.json verification profiles")
    parser.add_argument("--trust-store", type=Path, metavar="PATH",
                        help="persistent key/namespace acceptance file (default ~/.config/flare/trust.toml)")
    parser.add_argument("--model-cache", type=Path, metavar="PATH",
                        help="prepared-model cache (default: paths.package_cache, else ~/.cache/flare/packages)")


def run(args) -> int:
    import sys
    from flare.errors import UsageError
    from flare.frontend.chat_template import reply_parsers
    from flare.config import load_config
    from flare.package.inspect import InspectOptions, build_report, sections, to_json
    from flare.package.reader import open_package, open_unverified, resolve_target
    from flare.package.render import render
    from flare.package.store import lease_entry
    from flare.package.trust import TrustOptions

    if args.unverified and (args.publisher_keys or args.trust_store):
        raise UsageError("--unverified reads no keys; it cannot be combined with --publisher-keys or --trust-store")
    configuration = getattr(args, "configuration", None) or load_config(getattr(args, "config", None))
    cache_root = model_cache_root(args.model_cache, configuration)
    path = resolve_target(args.package, cache_root)
    options = InspectOptions(memory_map=args.memory_map, graphs=args.graphs, frontend=args.frontend, all=args.all,
                             rank=args.rank, tensor_parallel=args.tensor_parallel)
    with lease_entry(path):
        if args.unverified:
            package = open_unverified(path)
        else:
            trust = TrustOptions(publisher_keys=tuple(args.publisher_keys), trust_store=args.trust_store,
                                 offline=True, require_acceptance=False)
            package = open_package(path, trust)
        with package:
            report = build_report(package, options, reply_parsers,
                                  retained_states(configuration, package.files.primary.manifest_body))
    if args.json:
        print(to_json(report))
    else:
        names = report["model"]["served_names"] or [report["model"]["model_id"]]
        render(sections(report), sys.stdout, plain=args.plain, banner_name=names[0])
    return 0


def model_cache_root(explicit: Path | None, configuration=None) -> Path:
    """--model-cache, then [paths] package_cache of the configuration, then ~/.cache/flare/packages."""
    from flare.config import load_config, package_cache

    return package_cache(explicit, configuration if configuration is not None else load_config(None))


def retained_states(config, manifest_body: str) -> dict:
    """Where `flare run` keeps the prefix states of the package whose signed manifest is `manifest_body`
    when they leave the GPU, under the configuration `config`, and what the disk holds of them now."""
    from flare.engine.retention.disk_store import retained_on_disk
    from flare.engine.retention.settings import package_identity

    directory = config.paths.prefix_cache
    identity = package_identity(manifest_body)
    return {"identity": identity, "host_memory_bytes": config.prefix_cache.memory or None,
            "disk_directory": str(directory) if directory is not None else None,
            "disk_limit_bytes": config.prefix_cache.disk_limit,
            "disk": retained_on_disk(directory, identity) if directory is not None else []}
