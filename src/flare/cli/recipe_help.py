"""Help built from recipe declarations (spec section 2): the alias list in `ignition --help`, and a
recipe's defaults and limits for `ignition export ALIAS --help`.

Reads declarations only: no file, no GPU, no torch, no download.
"""

from __future__ import annotations

import sys

from flare.recipes import registry
from flare.models.quantization import fp8_weights_of
from flare.recipes.base import Checkpoint, Recipe, decode_weight_bytes, kv_bytes_per_token

# Preparation commands whose MODEL can name a recipe for `MODEL --help`.
RECIPE_HELP_COMMANDS = ("export", "debug-serve", "bench")


def _sizes(values) -> str:
    return ",".join(str(value) for value in values)


def _tp_sizes(recipe: Recipe, checkpoint: Checkpoint) -> tuple[int, ...]:
    return recipe.tensor_parallel_sizes_for(checkpoint.config)


def aliases_epilog() -> str:
    """Every declared alias with its tensor-parallel sizes and default/maximum draft counts."""
    rows = [("alias", "tensor parallel", "drafts (default/max)", "checkpoint")]
    for recipe, checkpoint in registry.all_checkpoints():
        spec = recipe.speculation_for(checkpoint)
        source = checkpoint.repo_id or "built locally"
        rows.append((checkpoint.alias, _sizes(_tp_sizes(recipe, checkpoint)),
                     f"{spec.default_draft_tokens}/{spec.max_draft_tokens}", source))
    widths = [max(len(row[column]) for row in rows) for column in range(3)]
    lines = ["model aliases:"]
    for row in rows:
        lines.append("  " + "  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[3])
    lines += ["",
              "MODEL is an alias, a Hugging Face repository id (org/name or org/name@revision) or a",
              "checkpoint directory. For a model's defaults and limits put it before --help:",
              "  ignition export qwen3-8b --help"]
    return "\n".join(lines)


def _gib(size: int) -> str:
    return f"{size / 1024 ** 3:.2f} GiB"


def _number(value: float) -> str:
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    return f"{value:,}" if isinstance(value, int) else f"{value:g}"


def _online_fp8(recipe: Recipe, checkpoint: Checkpoint) -> str:
    """What --online-mxfp8 would store for this checkpoint, and what a decode step then reads."""
    projections = tuple(recipe.online_fp8_projections)
    if not projections:
        return "unavailable: the recipe names no projections"
    if checkpoint.config and fp8_weights_of(checkpoint.config):
        return "unavailable: the checkpoint is already FP8"
    stored = f"--online-mxfp8 stores {', '.join(projections)} as FP8 e4m3, a float32 scale per 128x128 block"
    if not checkpoint.config:
        return stored
    return f"{stored}; decode then reads {_gib(decode_weight_bytes(checkpoint.config, online_fp8=projections))}"


def describe(recipe: Recipe, checkpoint: Checkpoint, command: str = "export") -> str:
    """A recipe's defaults, limits and optional features for one of its checkpoints."""
    spec = recipe.speculation_for(checkpoint)
    sampling = recipe.sampling_for(checkpoint)
    if checkpoint.source == "builtin":
        where = "built locally by flare.demo (no download)"
    else:
        where = f"{checkpoint.repo_id} @ {checkpoint.revision or 'unpinned: the hub current commit'}"
    rows = [
        ("checkpoint", where),
        ("architecture", checkpoint.architecture),
        ("served name", checkpoint.served_name),
    ]
    if checkpoint.stored_bytes is not None:
        rows.append(("stored weights", _gib(checkpoint.stored_bytes)))
    if checkpoint.decode_weight_bytes is not None:
        rows.append(("decode reads", f"{_gib(checkpoint.decode_weight_bytes)} of weights per request per step"))
    if checkpoint.context_length:
        rows.append(("context", f"{checkpoint.context_length:,} tokens (checkpoint maximum)"))
    rows += [
        ("tensor parallel", f"{', '.join(map(str, _tp_sizes(recipe, checkpoint)))} (the --gpus count)"),
        ("concurrency", f"{recipe.concurrency.minimum} through {recipe.concurrency.maximum}, "
                        f"default {recipe.concurrency.default} (--max-concurrency)"),
        ("KV page size", f"{recipe.page_size} tokens"),
    ]
    if checkpoint.config:
        stored = fp8_weights_of(checkpoint.config)
        rows.append(("weights", stored.describe() if stored else "the checkpoint's (bfloat16 when served on a GPU)"))
        rows += recipe.cache_help(checkpoint)
    rows.append(("online FP8", _online_fp8(recipe, checkpoint)))
    rows += [
        ("prefill chunk", f"{recipe.prefill_chunk:,} tokens (--prefill-chunk-size)"),
        ("decode capacities", f"{_sizes(recipe.decode_capacities_for(recipe.concurrency.maximum))} "
                              f"(captured batch sizes up to --max-concurrency)"),
        ("speculation", ("available" if spec.available else "unavailable")
                        + (f": {spec.note}" if spec.note else "")
                        + f"; draft tokens default {spec.default_draft_tokens}, maximum {spec.max_draft_tokens} "
                          f"(--mtp-draft-tokens), {spec.token_capacity} target rows per verification step "
                          f"(--speculative-token-capacity)"),
        ("images", "supported" if recipe.image_support else "not supported (text only)"),
        ("sampling defaults", ", ".join(f"{name} {_number(value)}" for name, value in sampling.defaults().items())),
        ("request ranges", ", ".join(f"{name} {_number(low)}..{_number(high)}"
                                     for name, (low, high) in sampling.ranges.items()) or "none: fixed at defaults"),
        ("sampling source", sampling.source),
    ]
    width = max(len(label) for label, _ in rows)
    lines = [f"{checkpoint.alias}: {recipe.title} recipe (version {recipe.version})"]
    lines += [f"  {label.ljust(width)}  {value}" for label, value in rows]
    lines += ["", f"Flags override these defaults; `ignition {command} --help` lists every option."]
    return "\n".join(lines) + "\n"


def lookup(model: str) -> tuple[Recipe, Checkpoint] | None:
    """An alias, or a declared repository id with or without @revision."""
    if "/" in model:
        return registry.find_repository(model.split("@", 1)[0])
    return registry.find_alias(model)


def recipe_help(argv: list[str]) -> str | None:
    """Help text for `ignition CMD MODEL --help` when MODEL names a recipe; None for ordinary help.

    A MODEL that names nothing declared falls back to ordinary help, with a note on stderr.
    """
    if not argv or argv[0] not in RECIPE_HELP_COMMANDS:
        return None
    for token in argv[1:]:
        if token == "--":
            break
        if token.startswith("-"):
            continue
        found = lookup(token)
        if found is not None:
            return describe(*found, command=argv[0])
        suggestion = registry.suggest_alias(token) if "/" not in token else None
        if suggestion:
            print(f"note: {token!r} is not a declared alias; did you mean {suggestion}?", file=sys.stderr)
    return None
