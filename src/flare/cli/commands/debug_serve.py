"""`ignition debug-serve [MODEL]`: prepare a checkpoint and serve it in one process, writing no package.

For diagnosing model and preparation faults; export a package and `flare run` it for real serving.
"""

from __future__ import annotations

import json
from pathlib import Path


def configure(parser):
    parser.add_argument("model", nargs="?", metavar="MODEL",
                        help="recipe alias, Hugging Face repository id (org/name[@revision]) or checkpoint "
                             "directory (default: defaults.model)")
    parser.add_argument("--gpus", metavar="LIST",
                        help="GPU indices: 0, 0,1 or 0-3, relative to CUDA_VISIBLE_DEVICES when it is set; one GPU "
                             "(default: the first visible GPU)")
    parser.add_argument("--host", metavar="ADDR", help="listening address (default: server.host, else 127.0.0.1)")
    parser.add_argument("--port", type=int, metavar="N", help="listening port (default: server.port, else 8000)")
    parser.add_argument("--max-concurrency", type=int, metavar="N",
                        help="maximum simultaneously active requests (default: defaults.max_concurrency, "
                             "else the recipe default)")
    parser.add_argument("--served-model-name", metavar="ALIAS", help="serve under this alias instead")
    parser.add_argument("--api-key-file", type=Path, metavar="PATH",
                        help="file containing the API key; an empty file disables authentication")
    from flare.cli.speculation_flags import add_preparation_arguments, add_serving_arguments

    add_preparation_arguments(parser, with_fixed=False)
    add_serving_arguments(parser, draft_tokens=False)


def run(args) -> int:
    from dataclasses import replace

    from flare.cli.speculation_flags import preparation_flags, serving_flags
    from flare.config import MAX_CONCURRENCY, PORT, check_flag
    from flare.memory import parse_gpus
    from flare.server.launch import DebugOptions, ListenerOptions, debug_serve
    from flare.server.settings import SamplingPolicy

    for setting, value in ((MAX_CONCURRENCY, args.max_concurrency), (PORT, args.port)):
        check_flag(setting, value)                         # before MODEL is resolved or downloaded
    gpus = parse_gpus(args.gpus) if args.gpus else None
    configuration = getattr(args, "configuration", None)
    if configuration is None:
        from flare.config import load_config

        configuration = load_config(getattr(args, "config", None))
    serving = serving_flags(args)
    preparing = replace(preparation_flags(args), fixed_verification=serving.adaptive is False)
    directory, facts, resolved = _resolve(args.model, configuration)
    listener = ListenerOptions(host=args.host, port=args.port, served_model_name=args.served_model_name,
                               api_key_file=args.api_key_file, max_concurrency=args.max_concurrency,
                               gpus=gpus, speculation=serving)
    options = DebugOptions(checkpoint_dir=directory, canonical_id=facts.model_id,
                           served_names=facts.served_names or (facts.model_id,), listener=listener,
                           config=configuration, recipe_concurrency=facts.default_concurrency,
                           recipe_max_concurrency=facts.max_concurrency, decode_capacities=facts.decode_capacities,
                           page_size=facts.page_size, prefill_chunk=facts.prefill_chunk,
                           sampling=SamplingPolicy(facts.sampling_defaults, facts.sampling_ranges),
                           **_speculation(facts, preparing, configuration, args.max_concurrency, directory, resolved))
    return debug_serve(options)


def _speculation(facts, flags, configuration, max_concurrency, directory, resolved) -> dict:
    """The speculation a package of this checkpoint would record (from the recipe and the preparation
    flags) and its learned draft's directory, as DebugOptions fields."""
    from flare.config import MAX_CONCURRENCY, resolve
    from flare.prepare import CheckpointSource, draft_record
    from flare.recipes.base import decode_capacities_for
    from flare.speculation_plan import fetch_draft, plan_speculation

    names = (facts.model_id, *facts.served_names, facts.alias)
    concurrency = resolve(MAX_CONCURRENCY, max_concurrency, configuration, facts.default_concurrency,
                          names=names).value
    capacities = decode_capacities_for(facts.decode_capacities, min(concurrency, facts.max_concurrency))
    found = None if flags.no_mtp else fetch_draft(facts.speculation, directory, resolved.options)
    draft_dir = found[0] if found else None
    hf_config = json.loads((Path(directory) / "config.json").read_text())
    draft = draft_record(CheckpointSource(directory, *((None, None, None, *found) if found else ())), hf_config)
    plan = plan_speculation(facts.speculation, flags, configuration, names, capacities,
                            facts.alias or facts.model_id, draft)
    return {"speculation": plan, "draft_dir": draft_dir if plan is not None else None}


def _resolve(model: str | None, configuration):
    """MODEL (or defaults.model) to a complete local checkpoint and what its recipe says about serving it."""
    from flare.prepare import RecipeFacts
    from flare.resolve import fetch, resolve_model

    resolved = resolve_model(model, configuration)
    return Path(fetch(resolved)), RecipeFacts.from_resolved(resolved), resolved
