"""Recipes: per-model-family declarations and memory cost models (spec section 9).

Importable without torch. Look-ups live in `flare.recipes.registry`.
"""

from flare.recipes.base import Checkpoint, ConcurrencyRange, Recipe, SamplingDefaults, Speculation
from flare.recipes.registry import (all_recipes, find_alias, find_repository, recipe_for_architecture,
                                    suggest_alias, supported_aliases, unknown_alias_error)

__all__ = ["Checkpoint", "ConcurrencyRange", "Recipe", "SamplingDefaults", "Speculation", "all_recipes",
           "find_alias", "find_repository", "recipe_for_architecture", "suggest_alias", "supported_aliases",
           "unknown_alias_error"]
