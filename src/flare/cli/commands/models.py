"""`flare models list|inspect|select|remove|gc`: manage the prepared-model cache."""

from __future__ import annotations

import argparse
from pathlib import Path


def configure(parser):
    parser.add_argument("--model-cache", dest="global_model_cache", type=Path, metavar="PATH",
                        help="prepared-model cache (default: paths.package_cache, else ~/.cache/flare/packages)")
    sub = parser.add_subparsers(dest="models_command", metavar="COMMAND", required=True)

    def add(name, summary):
        child = sub.add_parser(name, help=summary, description=summary)
        return child

    listing = add("list", "cached models, versions, capacities and storage figures (unverified metadata)")
    listing.add_argument("model", nargs="?", metavar="MODEL", help="only this model")
    _output_flags(listing)
    from flare.cli.commands import inspect as inspect_command
    inspect_command.configure(add("inspect", "describe a cached package (same flags as `flare inspect`)"))
    from flare.cli.commands import download as download_command
    download_command.configure(add("download", "download a prepared package (same as `flare download`)"))
    select = add("select", "make MODEL@VERSION the model's default")
    select.add_argument("entry", metavar="MODEL@VERSION")
    remove = add("remove", "remove a cached version")
    remove.add_argument("entry", metavar="MODEL@VERSION")
    remove.add_argument("--clear-default", action="store_true",
                        help="allow removing the selected default; the model is left with no default")
    remove.add_argument("--plain", action="store_true", help=argparse.SUPPRESS)
    gc = add("gc", "remove abandoned staging trees, payload objects no entry references, transfers failed "
                   "downloads left behind and download records of removed entries")
    _output_flags(gc)
    for child in (listing, select, remove, gc):
        child.add_argument("--model-cache", type=Path, metavar="PATH", default=None,
                           help="prepared-model cache")


def _output_flags(parser):
    group = parser.add_mutually_exclusive_group()
    group.add_argument("--json", action="store_true", help="structured output with exact byte counts")
    group.add_argument("--plain", action="store_true", help="no terminal styling")


def run(args) -> int:
    from flare.cli.commands.inspect import model_cache_root
    explicit = getattr(args, "model_cache", None) or args.global_model_cache
    if args.models_command == "download":
        from flare.cli.commands import download as download_command
        return download_command.run(args)
    if args.models_command == "inspect":
        from flare.cli.commands import inspect as inspect_command
        args.model_cache = explicit
        return inspect_command.run(args)
    from flare.package.store import ModelCache
    cache = ModelCache(model_cache_root(explicit, getattr(args, "configuration", None)))
    return {"list": _list, "select": _select, "remove": _remove, "gc": _gc}[args.models_command](cache, args)


def _entry(cache, text: str):
    from flare.errors import UsageError
    if "@" not in text:
        raise UsageError(f"{text}: name a version as MODEL@VERSION (`flare models list` shows them)")
    return cache.resolve(text)


def _select(cache, args) -> int:
    entry = _entry(cache, args.entry)
    cache.select(entry)
    print(f"selected {entry}")
    return 0


def _remove(cache, args) -> int:
    entry = _entry(cache, args.entry)
    cache.remove(entry, clear_default=args.clear_default)
    print(f"removed {entry}; `flare models gc` reclaims payloads no other entry uses")
    return 0


def _gc(cache, args) -> int:
    import json
    from flare.ui.progress import format_bytes
    from flare.package.download import remove_abandoned_transports
    from flare.package.sources import SourceRecords
    result = {"removed_staging": [], "removed_blobs": [], "removed_transport": [], "removed_source_records": [],
              "reclaimed_bytes": 0}
    if cache.root.is_dir():
        result.update(cache.gc())
        result["removed_transport"], transport_bytes = remove_abandoned_transports(cache)
        result["reclaimed_bytes"] += transport_bytes
        result["removed_source_records"] = SourceRecords(cache).prune_removed()
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"removed {len(result['removed_staging'])} staging trees, {len(result['removed_blobs'])} payload "
              f"objects, {len(result['removed_transport'])} abandoned transfers and "
              f"{len(result['removed_source_records'])} records of removed downloads; "
              f"reclaimed {format_bytes(result['reclaimed_bytes'])}")
    return 0


def _list(cache, args) -> int:
    import json
    import sys
    from flare.package.listing import list_models
    from flare.package.render import Section, render
    from flare.ui.progress import format_bytes
    listing = list_models(cache, args.model)
    if args.json:
        print(json.dumps(listing, indent=2))
        return 0
    if not listing["models"]:
        print(f"no models in {cache.root}; prepare one with `ignition export`")
        return 0
    sections = []
    for model in listing["models"]:
        versions, storage = [], []
        for version in model["versions"]:
            marks = ", ".join(m for m, on in (("default", version["selected"]), ("in use", version["in_use"])) if on)
            deployments = version.get("deployments") or []
            capacity = ", ".join(f"TP{d['tensor_parallel']} × {d['max_concurrency']:,}" for d in deployments) or "-"
            reclaimable = (format_bytes(version["reclaimable_bytes"]) if version.get("reclaimable_bytes") is not None
                           else "-")
            versions.append([version["version"], marks or "-", capacity, version.get("publisher") or "-"])
            storage.append([version["version"], format_bytes(version.get("logical_bytes")),
                            format_bytes(version.get("disk_physical_bytes")),
                            format_bytes(version.get("shared_physical_bytes")), reclaimable])
        # Two tables: the seven columns of one do not fit 80 columns without cutting a header or a size.
        sections.append(Section(f"{model['model_key']} (unverified metadata)",
                                table=(["version", "", "capacity", "publisher"], versions)))
        sections.append(Section(f"{model['model_key']} storage",
                                table=(["version", "logical", "on disk", "shared", "reclaimable"], storage)))
    render(sections, sys.stdout, plain=args.plain)
    return 0
