"""MODEL → recipe and checkpoint (spec section 8): a directory, a hub repository, or a declared alias.

1. An existing directory is a checkpoint directory.
2. A string containing `/` is a repository id with an optional `@revision`. A declared repository (matched
   without regard to casing) at its pinned revision, or with no revision, is the qualified checkpoint.
3. Anything else is an alias.

Any other directory or repository is served by the recipe whose architecture its config.json names.
Resolution reads config.json and the weights' sizes, never the tensors; `fetch` brings the checkpoint.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from flare.config import MODEL, Config, resolve
from flare.errors import UsageError
from flare.hub import (
    CONFIG_NAME,
    HubOptions,
    WeightsInfo,
    download_snapshot,
    local_weights,
    missing_checkpoint_files,
    read_json,
    read_repository,
)
from flare.recipes import registry
from flare.recipes.base import Checkpoint, Recipe

LOCAL_REVISION = "local"  # what the spec records as the revision of a local checkpoint
DEMO_CACHE = Path("~/.cache/flare/demo")
# The hub's repository naming: a namespace and a name of letters, digits, '-', '_' and '.'.
_REPO_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
_PATH_PREFIXES = ("/", "./", "../", "~")


@dataclass(frozen=True)
class ResolvedModel:
    """A resolved MODEL: which recipe serves it, where its files come from, and what its config says.

    source: "directory" (a local checkpoint), "hub" (a repository id), "alias" (a declared hub checkpoint
        named by alias) or "builtin" (the demo, built locally).
    revision: the commit the checkpoint is read at; "local" for directories and the demo.
    requested_revision: what the user asked for (a branch, tag or commit), None when nothing was named;
        it differs from `revision` when a branch or the repository's current commit was resolved.
    weights: the safetensors files and their stored bytes, for the memory estimate.
    directory: the local checkpoint directory for "directory" and "builtin" sources.
    """

    recipe: Recipe
    checkpoint: Checkpoint | None
    source: str
    repo_id: str | None
    revision: str
    requested_revision: str | None
    hf_config: dict
    weights: WeightsInfo
    directory: Path | None
    options: HubOptions

    @property
    def stored_bytes(self) -> int:
        return self.weights.total_bytes

    @property
    def architecture(self) -> str:
        return next(iter(self.hf_config.get("architectures") or []), "")

    @property
    def revision_was_resolved(self) -> bool:
        """True when the commit was looked up (a branch, a tag, or no revision): worth reporting."""
        return self.repo_id is not None and self.requested_revision != self.revision

    def describe(self) -> str:
        """One line for the export log: what was resolved, and the commit a branch or no revision gave."""
        alias = f"{self.checkpoint.alias}: " if self.checkpoint is not None else ""
        if self.source == "builtin":
            return f"{alias}built locally in {self.directory}"
        if self.source == "directory":
            return f"checkpoint directory {self.directory} ({self.kind})"
        if self.requested_revision is None and self.revision_was_resolved:
            where = f"{self.repo_id} at its current commit {self.revision}"
        elif self.revision_was_resolved:
            where = f"{self.repo_id}@{self.requested_revision} = commit {self.revision}"
        else:
            where = f"{self.repo_id} at commit {self.revision}"
        return f"{alias}{where} ({self.kind})"

    @property
    def kind(self) -> str:
        """What the checkpoint is: the recipe's title for a checkpoint it declares; otherwise its own
        architecture and the recipe family that serves it (a small Llama-architecture checkpoint is not
        "Llama 3.x")."""
        if self.checkpoint is not None:
            return self.recipe.title
        return f"{self.architecture or 'unknown architecture'}, served by the {self.recipe.family} recipe"


def resolve_model(model: str | None, config: Config, options: HubOptions | None = None) -> ResolvedModel:
    """Resolve MODEL (or `defaults.model` when it is None) in the spec's order.

    `options` replaces the hub settings `config` gives (a command's --token-file, tests' own hub).
    """
    model = resolve(MODEL, model, config).value
    if not model:
        raise UsageError(
            f"no MODEL given and defaults.model is not set in {config.path}; name an alias (such as demo, "
            "the built-in demonstration model), a repository (org/name or org/name@revision) or a "
            "checkpoint directory")
    options = options or HubOptions.from_config(config)
    path = Path(model).expanduser()
    if path.is_dir():
        return _resolve_directory(path.absolute(), options)
    if model.startswith(_PATH_PREFIXES):
        raise UsageError(f"{model} is not a directory; a checkpoint directory must exist")
    if "/" in model:
        return _resolve_repository(model, options)
    return _resolve_alias(model, options)


def fetch(resolved: ResolvedModel, options: HubOptions | None = None) -> Path:
    """A complete local checkpoint directory for a resolved model, downloading it if it is not cached."""
    options = options or resolved.options
    if resolved.source == "builtin":
        return _demo_checkpoint()
    if resolved.directory is not None:
        missing = missing_checkpoint_files(resolved.directory)
        if missing:
            raise UsageError(f"the checkpoint directory {resolved.directory} lacks {', '.join(missing)}")
        return resolved.directory
    return download_snapshot(resolved.repo_id, resolved.revision, options)


# -- the three kinds of MODEL ---------------------------------------------------------------------------


def _resolve_directory(directory: Path, options: HubOptions) -> ResolvedModel:
    hf_config, weights = _read_local_checkpoint(directory)
    recipe = _recipe_for(hf_config, str(directory))
    return ResolvedModel(recipe, None, "directory", None, LOCAL_REVISION, None, hf_config, weights, directory,
                         options)


def _read_local_checkpoint(directory: Path) -> tuple[dict, WeightsInfo]:
    missing = missing_checkpoint_files(directory)
    if CONFIG_NAME in missing:
        raise UsageError(f"{directory} has no {CONFIG_NAME}; a checkpoint directory holds config.json and "
                         "safetensors weights")
    if missing:
        raise UsageError(f"the checkpoint directory {directory} lacks {', '.join(missing)}")
    return read_json(directory / CONFIG_NAME, "the checkpoint configuration"), local_weights(directory)


def _resolve_repository(model: str, options: HubOptions) -> ResolvedModel:
    repo_id, _, revision = model.partition("@")
    revision = revision or None
    if not _REPO_ID.fullmatch(repo_id):
        raise UsageError(f"{model} is neither an existing directory nor a repository id "
                         "(org/name or org/name@revision)")
    declared = registry.find_repository(repo_id)
    checkpoint = None
    if declared is not None:
        recipe, checkpoint = declared
        if revision is None or revision.lower() == (checkpoint.revision or "").lower():
            return _resolve_checkpoint(recipe, checkpoint, "hub", options)
        repo_id = checkpoint.repo_id
    metadata = read_repository(repo_id, revision, options)
    if checkpoint is not None and metadata.revision == checkpoint.revision:
        recipe = declared[0]  # a branch, tag or short commit that names the pinned revision
    else:
        checkpoint = None  # any other revision is served by the recipe of its architecture
        recipe = _recipe_for(metadata.hf_config, model)
    return ResolvedModel(recipe, checkpoint, "hub", metadata.repo_id, metadata.revision, revision,
                         metadata.hf_config, metadata.weights, None, options)


def _resolve_alias(name: str, options: HubOptions) -> ResolvedModel:
    declared = registry.find_alias(name)
    if declared is None:
        raise registry.unknown_alias_error(name)
    recipe, checkpoint = declared
    return _resolve_checkpoint(recipe, checkpoint, "alias", options)


def _resolve_checkpoint(recipe: Recipe, checkpoint: Checkpoint, source: str, options: HubOptions) -> ResolvedModel:
    """A declared checkpoint: the demo is built locally; a hub checkpoint is read at its pinned revision."""
    if checkpoint.source == "builtin":
        directory = _demo_checkpoint()
        hf_config, weights = _read_local_checkpoint(directory)
        return ResolvedModel(recipe, checkpoint, "builtin", None, LOCAL_REVISION, None, hf_config, weights,
                             directory, options)
    metadata = read_repository(checkpoint.repo_id, checkpoint.revision, options)
    return ResolvedModel(recipe, checkpoint, source, checkpoint.repo_id, metadata.revision, checkpoint.revision,
                         metadata.hf_config, metadata.weights, None, options)


def _recipe_for(hf_config: dict, model: str) -> Recipe:
    architectures = hf_config.get("architectures") or []
    if not isinstance(architectures, list):
        architectures = []
    for architecture in architectures:
        recipe = registry.recipe_for_architecture(architecture)
        if recipe is not None:
            return recipe
    raise registry.unsupported_architecture_error(architectures, model)


def _demo_checkpoint() -> Path:
    from flare.demo import ensure_demo_checkpoint  # builds weights: only when the demo is asked for

    return Path(ensure_demo_checkpoint(DEMO_CACHE.expanduser()))
