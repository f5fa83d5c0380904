"""`ignition export [MODEL]`: prepare a model and publish it in the shared model cache."""

from __future__ import annotations

from pathlib import Path


def configure(parser):
    from flare.models.quantization import KV_CACHE_DTYPES, KV_CACHE_HELP, ONLINE_FP8_HELP

    parser.add_argument("model", nargs="?", metavar="MODEL",
                        help="recipe alias, Hugging Face repository id (org/name[@revision]) or checkpoint "
                             "directory (default: defaults.model)")
    parser.add_argument("--gpus", metavar="LIST", help="GPU indices: 0, 0,1 or 0-3 (default: first GPUs that fit)")
    parser.add_argument("--max-concurrency", type=int, metavar="N", help="maximum simultaneously active requests")
    parser.add_argument("--prefill-chunk-size", type=int, metavar="N",
                        help="most prompt tokens in one prefill step, a multiple of 64 (default: the recipe's)")
    weights = parser.add_mutually_exclusive_group()
    weights.add_argument("--no-weights", action="store_true",
                         help="export only when exact weight payloads are already cached")
    weights.add_argument("--reuse-weights", action="store_true",
                         help="reuse the cached default version's weight payloads without reading weights")
    precision = parser.add_argument_group("capacity and compression")
    precision.add_argument("--online-mxfp8", action="store_true",
                           help=f"{ONLINE_FP8_HELP}. Recipes that name no such projections reject it. Command line "
                                "only (default: checkpoint precision)")
    precision.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, metavar="{auto,fp8}",
                           help=f"{KV_CACHE_HELP}. Command line only (default: auto)")
    parser.add_argument("--publisher-key", action="append", type=Path, default=[], metavar="PATH",
                        help="public publisher profile authenticating the cached weight source")
    parser.add_argument("--repo-id", metavar="NAMESPACE/REPOSITORY",
                        help="Hugging Face target recorded for the exported entry (default: the recipe's)")
    parser.add_argument("--official-source", metavar="URL",
                        help="published repository URL under the configured publisher namespace")
    parser.add_argument("--config", type=Path, metavar="PATH",
                        help="configuration file (default ~/.config/flare/config.toml)")
    parser.add_argument("--verbose", action="store_true", help="per-phase detail on stderr")
    from flare.cli.speculation_flags import add_preparation_arguments

    add_preparation_arguments(parser)
    advanced = parser.add_argument_group("advanced")
    advanced.add_argument("--compile-workers", type=int, metavar="N",
                          help="CPU compiler processes for compiling forwards (overrides [preparation] "
                               "compile_workers; default: automatic)")
    advanced.add_argument("--no-compile", action="store_true",
                          help="development only: capture graphs without compiling forwards")


def run(args) -> int:
    from flare.cli.speculation_flags import preparation_flags
    from flare.prepare import ExportOptions, check_flags, export_model
    from flare.ui.progress import PhaseProgress

    from flare.errors import UsageError

    if args.repo_id is not None and args.repo_id.count("/") != 1:
        raise UsageError(f"--repo-id {args.repo_id} is not NAMESPACE/REPOSITORY")
    if args.publisher_key and not args.reuse_weights:
        raise UsageError("--publisher-key authenticates the cached version that --reuse-weights takes its weights "
                         "from; without --reuse-weights it has nothing to check: add --reuse-weights or drop it")
    options = ExportOptions(
        max_concurrency=args.max_concurrency, prefill_chunk=args.prefill_chunk_size, gpus=args.gpus,
        weight_mode="no-weights" if args.no_weights else "reuse-weights" if args.reuse_weights else "normal",
        repo_id=args.repo_id, official_source=args.official_source, publisher_keys=tuple(args.publisher_key),
        config_path=args.config, compile=not args.no_compile, compile_workers=args.compile_workers,
        online_fp8=args.online_mxfp8, kv_cache_dtype=args.kv_cache_dtype,
        speculation=preparation_flags(args))
    check_flags(options)                                   # before MODEL is resolved or downloaded
    source, recipe = _resolve(args, options.speculation.no_mtp)
    entry = export_model(source, recipe, options, PhaseProgress(verbose=args.verbose))
    print(entry)
    return 0


def _resolve(args, no_mtp: bool):
    """MODEL (or defaults.model) to a complete local checkpoint and the facts of its recipe; with its learned
    draft, unless --no-mtp (spec §8: the draft is fetched into the same hub cache, or supplied in draft/)."""
    from flare.prepare import CheckpointSource, RecipeFacts
    from flare.resolve import fetch, resolve_model
    from flare.speculation_plan import fetch_draft
    resolved = resolve_model(args.model, args.configuration)
    directory = Path(fetch(resolved))
    facts = RecipeFacts.from_resolved(resolved)
    draft = None if no_mtp else fetch_draft(facts.speculation, directory, resolved.options)
    source = CheckpointSource(directory, resolved.repo_id, resolved.revision, resolved.describe(),
                              *(draft or (None, None, None)))
    return source, facts
