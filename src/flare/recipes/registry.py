"""Every recipe Flare ships, and the look-ups the command line and model resolution use.

Imports nothing heavy: `ignition --help` lists these declarations without loading torch.
"""

from __future__ import annotations

import difflib

from flare.errors import UsageError
from flare.recipes import deepseek, deepseek_v4, demo, llama, mistral, qwen2, qwen3
from flare.recipes.base import Checkpoint, Recipe

# Order matters only for `recipe_for_architecture`: the Llama family comes before the demo, which
# shares its architecture but serves only its own built-in checkpoint.
_RECIPES: tuple[Recipe, ...] = (llama.RECIPE, qwen2.RECIPE, qwen3.RECIPE, mistral.RECIPE, deepseek.RECIPE,
                                deepseek_v4.RECIPE, demo.RECIPE)
# Aliases the specification names that no recipe serves, each with the reason (a recipe module's WITHHELD).
_WITHHELD: dict[str, str] = {**deepseek_v4.WITHHELD}


def all_recipes() -> tuple[Recipe, ...]:
    return _RECIPES


def all_checkpoints() -> list[tuple[Recipe, Checkpoint]]:
    return [(recipe, checkpoint) for recipe in _RECIPES for checkpoint in recipe.checkpoints]


def find_alias(name: str) -> tuple[Recipe, Checkpoint] | None:
    """The recipe and checkpoint a declared alias names, ignoring case."""
    wanted = name.strip().lower()
    for recipe, checkpoint in all_checkpoints():
        if checkpoint.alias.lower() == wanted:
            return recipe, checkpoint
    return None


def find_repository(repo_id: str) -> tuple[Recipe, Checkpoint] | None:
    """The declared checkpoint whose repository this is, ignoring case (spec section 8).

    Takes a bare `org/name`; comparing a requested @revision with the pinned one is the caller's job.
    """
    wanted = repo_id.strip().lower()
    for recipe, checkpoint in all_checkpoints():
        if checkpoint.repo_id is not None and checkpoint.repo_id.lower() == wanted:
            return recipe, checkpoint
    return None


def recipe_for_architecture(architecture: str) -> Recipe | None:
    """The recipe that serves checkpoints whose config.json names this architecture."""
    for recipe in _RECIPES:
        if architecture in recipe.architectures:
            return recipe
    return None


def supported_aliases() -> list[str]:
    return sorted(checkpoint.alias for _, checkpoint in all_checkpoints())


def supported_architectures() -> list[str]:
    return sorted({architecture for recipe in _RECIPES for architecture in recipe.architectures})


def suggest_alias(name: str) -> str | None:
    """The declared alias closest to a mistyped one, if any is close."""
    matches = difflib.get_close_matches(name.strip().lower(), supported_aliases(), n=1, cutoff=0.6)
    return matches[0] if matches else None


def unknown_alias_error(name: str) -> UsageError:
    """The usage error for a MODEL that is neither a directory, a repository id nor a declared alias."""
    withheld = _WITHHELD.get(name.strip().lower())
    if withheld is not None:
        return UsageError(withheld)
    suggestion = suggest_alias(name)
    hint = f"; did you mean {suggestion}?" if suggestion else ""
    return UsageError(
        f"unknown model alias {name!r}{hint}\n"
        f"       Supported aliases: {', '.join(supported_aliases())}.\n"
        f"       MODEL may also be a Hugging Face repository id (org/name or org/name@revision) or a "
        f"checkpoint directory; `ignition --help` lists every alias.")


def unsupported_architecture_error(architectures: list[str] | tuple[str, ...], model: str) -> UsageError:
    """The usage error for a checkpoint whose config.json names no architecture a recipe supports."""
    named = ", ".join(architectures) or "none"
    return UsageError(
        f"{model} declares architecture {named}, which no recipe supports.\n"
        f"       Supported architectures: {', '.join(supported_architectures())}; "
        f"supported aliases: {', '.join(supported_aliases())}.")
