"""MODEL resolution (spec section 8) against the real recipe registry and a hub-compatible test server."""

from __future__ import annotations

import sys
import types
from dataclasses import replace
from pathlib import Path

import pytest
from hub_server import fake_commit, hub, write_checkpoint  # noqa: F401  (hub is a fixture)

from flare.config import Config, DefaultsConfig, HubConfig, default_paths
from flare.errors import FetchError, UsageError
from flare.hub import HubOptions, download_snapshot, repo_folder_name
from flare.recipes import registry
from flare.resolve import fetch, resolve_model


def pinned_hub_checkpoint():
    """A declared hub checkpoint with a pinned revision, as the registry declares it."""
    for recipe, checkpoint in registry.all_checkpoints():
        if checkpoint.source == "hub" and checkpoint.revision is not None:
            return recipe, checkpoint
    pytest.skip("no recipe declares a pinned hub checkpoint")


def make_config(hub_url: str, cache: Path, default_model: str | None = None) -> Config:
    return Config(path=cache.parent / "config.toml", paths=replace(default_paths(), hub_cache=cache),
                  hub=HubConfig(endpoint=hub_url), defaults=DefaultsConfig(model=default_model))


@pytest.fixture
def config(hub, tmp_path):
    return make_config(hub.url, tmp_path / "hub-cache")


def publish(hub, tmp_path, repo_id, architecture="LlamaForCausalLM", **kwargs):
    shards = kwargs.pop("shards", 1)
    folder = write_checkpoint(tmp_path / f"src-{fake_commit()[:8]}", architecture=architecture, shards=shards)
    return hub.add_commit(repo_id, folder, **kwargs)


# -- directories ----------------------------------------------------------------------------------------


def test_an_existing_directory_is_a_checkpoint_directory(stories260k, config, hub):
    resolved = resolve_model(str(stories260k), config)
    assert resolved.source == "directory"
    assert resolved.recipe is registry.recipe_for_architecture("LlamaForCausalLM")
    assert resolved.checkpoint is None
    assert resolved.revision == "local"
    assert resolved.hf_config["vocab_size"] == 512
    assert resolved.weights.total_bytes == (stories260k / "model.safetensors").stat().st_size
    assert fetch(resolved) == stories260k
    assert hub.requests == []


def test_a_directory_wins_even_when_its_name_looks_like_a_repository(tmp_path, config, monkeypatch, hub):
    write_checkpoint(tmp_path / "org" / "name")
    monkeypatch.chdir(tmp_path)
    resolved = resolve_model("org/name", config)
    assert resolved.source == "directory"
    assert resolved.directory == tmp_path / "org" / "name"
    assert hub.requests == []


def test_a_directory_of_an_unsupported_architecture_lists_the_aliases(tmp_path, config):
    folder = write_checkpoint(tmp_path / "gpt2", architecture="GPT2LMHeadModel")
    with pytest.raises(UsageError, match="GPT2LMHeadModel") as raised:
        resolve_model(str(folder), config)
    assert raised.value.exit_code == 2
    for alias in registry.supported_aliases():
        assert alias in str(raised.value)


def test_a_directory_without_config_or_with_missing_shards_is_a_usage_error(tmp_path, config):
    (tmp_path / "empty").mkdir()
    with pytest.raises(UsageError, match="config.json"):
        resolve_model(str(tmp_path / "empty"), config)
    folder = write_checkpoint(tmp_path / "sharded", shards=2)
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(UsageError, match="model-00002-of-00002.safetensors"):
        resolve_model(str(folder), config)


def test_a_path_that_does_not_exist_is_not_taken_for_a_repository(config, hub):
    with pytest.raises(UsageError, match="not a directory"):
        resolve_model("./missing-checkpoint", config)
    with pytest.raises(UsageError, match="repository id"):
        resolve_model("a/b/c", config)
    assert hub.requests == []


# -- repositories ---------------------------------------------------------------------------------------


def test_a_repository_with_a_branch_resolves_to_its_commit(hub, tmp_path, config):
    commit = publish(hub, tmp_path, "Someone/Tiny-Llama", shards=2)
    resolved = resolve_model("Someone/Tiny-Llama@main", config)
    assert resolved.source == "hub"
    assert resolved.checkpoint is None
    assert resolved.recipe is registry.recipe_for_architecture("LlamaForCausalLM")
    assert (resolved.repo_id, resolved.revision, resolved.requested_revision) == ("Someone/Tiny-Llama", commit, "main")
    assert resolved.revision_was_resolved
    assert f"Someone/Tiny-Llama@main = commit {commit}" in resolved.describe()
    assert resolved.stored_bytes == 2 * 4096
    assert hub.safetensors_bodies_served == []
    path = fetch(resolved)
    assert path.name == commit and (path / "model-00002-of-00002.safetensors").is_file()


def test_a_repository_without_revision_uses_and_reports_the_current_commit(hub, tmp_path, config):
    publish(hub, tmp_path, "Someone/Tiny-Llama")
    current = publish(hub, tmp_path, "Someone/Tiny-Llama")
    resolved = resolve_model("Someone/Tiny-Llama", config)
    assert resolved.revision == current and resolved.requested_revision is None
    assert f"current commit {current}" in resolved.describe()
    pinned = resolve_model(f"Someone/Tiny-Llama@{current}", config)
    assert not pinned.revision_was_resolved and f"Someone/Tiny-Llama at commit {current}" in pinned.describe()


def test_a_repository_of_an_unsupported_architecture_is_a_usage_error(hub, tmp_path, config):
    publish(hub, tmp_path, "Someone/Gpt2", architecture="GPT2LMHeadModel")
    with pytest.raises(UsageError, match="GPT2LMHeadModel") as raised:
        resolve_model("Someone/Gpt2", config)
    assert registry.supported_aliases()[0] in str(raised.value)
    assert hub.safetensors_bodies_served == []


def test_a_repository_the_hub_cannot_provide_is_a_fetch_error(hub, config):
    with pytest.raises(FetchError, match="Someone/Absent") as raised:
        resolve_model("Someone/Absent@main", config)
    assert raised.value.exit_code == 3


def test_a_repository_without_safetensors_is_a_usage_error(hub, tmp_path, config):
    folder = tmp_path / "bin-only"
    folder.mkdir()
    (folder / "config.json").write_text('{"architectures": ["LlamaForCausalLM"]}')
    (folder / "pytorch_model.bin").write_bytes(b"0" * 16)
    hub.add_commit("Someone/Bin-Only", folder)
    with pytest.raises(UsageError, match="safetensors"):
        resolve_model("Someone/Bin-Only", config)


# -- declared checkpoints -------------------------------------------------------------------------------


def test_an_alias_resolves_to_its_pinned_revision(hub, tmp_path, config):
    recipe, checkpoint = pinned_hub_checkpoint()
    publish(hub, tmp_path, checkpoint.repo_id, checkpoint.architecture, commit=checkpoint.revision, refs=())
    main = publish(hub, tmp_path, checkpoint.repo_id, checkpoint.architecture)  # the branch moved on
    resolved = resolve_model(checkpoint.alias, config)
    assert resolved.source == "alias"
    assert (resolved.recipe, resolved.checkpoint) == (recipe, checkpoint)
    assert resolved.revision == checkpoint.revision != main
    assert not resolved.revision_was_resolved
    path = fetch(resolved)
    assert path.name == checkpoint.revision
    assert path.parts[-3] == repo_folder_name(checkpoint.repo_id)


def test_an_alias_reuses_a_complete_snapshot_without_any_request(hub, tmp_path, config):
    _, checkpoint = pinned_hub_checkpoint()
    publish(hub, tmp_path, checkpoint.repo_id, checkpoint.architecture, commit=checkpoint.revision)
    path = fetch(resolve_model(checkpoint.alias, config))
    hub.clear_log()
    resolved = resolve_model(checkpoint.alias, config)
    assert fetch(resolved) == path
    assert resolved.hf_config["architectures"] == [checkpoint.architecture]
    assert hub.requests == []


def test_an_alias_reuses_a_snapshot_cached_under_another_casing(hub, tmp_path, config):
    _, checkpoint = pinned_hub_checkpoint()
    publish(hub, tmp_path, checkpoint.repo_id, checkpoint.architecture, commit=checkpoint.revision)
    options = HubOptions.from_config(config)
    variant = download_snapshot(checkpoint.repo_id.lower(), checkpoint.revision, options)  # another tool's casing
    assert variant.parts[-3] == repo_folder_name(checkpoint.repo_id.lower()) != repo_folder_name(checkpoint.repo_id)
    hub.clear_log()
    assert fetch(resolve_model(checkpoint.alias, config)) == variant
    assert hub.requests == []


def test_a_declared_repository_in_any_casing_without_revision_is_the_qualified_checkpoint(hub, tmp_path, config):
    recipe, checkpoint = pinned_hub_checkpoint()
    publish(hub, tmp_path, checkpoint.repo_id, checkpoint.architecture, commit=checkpoint.revision, refs=("v1",))
    publish(hub, tmp_path, checkpoint.repo_id, checkpoint.architecture)
    for model in (checkpoint.repo_id.upper(), f"{checkpoint.repo_id}@{checkpoint.revision}",
                  f"{checkpoint.repo_id.lower()}@v1"):
        resolved = resolve_model(model, config)
        assert resolved.source == "hub"
        assert resolved.checkpoint == checkpoint
        assert resolved.revision == checkpoint.revision
        assert resolved.repo_id == checkpoint.repo_id


def test_a_declared_repository_at_another_revision_is_served_by_architecture(hub, tmp_path, config):
    recipe, checkpoint = pinned_hub_checkpoint()
    publish(hub, tmp_path, checkpoint.repo_id, checkpoint.architecture, commit=checkpoint.revision, refs=())
    main = publish(hub, tmp_path, checkpoint.repo_id, checkpoint.architecture)
    resolved = resolve_model(f"{checkpoint.repo_id}@main", config)
    assert resolved.checkpoint is None
    assert resolved.recipe is registry.recipe_for_architecture(checkpoint.architecture)
    assert resolved.revision == main


def test_an_unknown_alias_is_a_usage_error_with_a_suggestion(config, hub):
    _, checkpoint = pinned_hub_checkpoint()
    with pytest.raises(UsageError, match=f"did you mean {checkpoint.alias}") as raised:
        resolve_model(checkpoint.alias[:-1], config)
    assert raised.value.exit_code == 2
    assert hub.requests == []


def test_the_demo_alias_is_built_locally(config, monkeypatch, tmp_path, isolated_home, hub):
    built = []

    def ensure_demo_checkpoint(directory: Path) -> Path:
        built.append(directory)
        return write_checkpoint(directory / "checkpoint")

    monkeypatch.setitem(sys.modules, "flare.demo", types.SimpleNamespace(ensure_demo_checkpoint=ensure_demo_checkpoint))
    resolved = resolve_model("demo", config)
    assert resolved.source == "builtin" and resolved.checkpoint.alias == "demo"
    assert fetch(resolved) == isolated_home / ".cache" / "flare" / "demo" / "checkpoint"
    assert built[0] == isolated_home / ".cache" / "flare" / "demo"
    assert hub.requests == []


# -- defaults.model -------------------------------------------------------------------------------------


def test_no_model_uses_defaults_model(hub, tmp_path):
    publish(hub, tmp_path, "Someone/Default")
    config = make_config(hub.url, tmp_path / "cache", default_model="Someone/Default")
    assert resolve_model(None, config).repo_id == "Someone/Default"


def test_no_model_and_no_default_is_a_usage_error(tmp_path):
    config = make_config("http://127.0.0.1:9", tmp_path / "cache")
    with pytest.raises(UsageError, match="defaults.model"):
        resolve_model(None, config)


def test_explicit_options_replace_the_configured_hub(hub, tmp_path):
    publish(hub, tmp_path, "Someone/Tiny")
    config = make_config("http://127.0.0.1:9", tmp_path / "unused")
    options = HubOptions(endpoint=hub.url, cache_dir=tmp_path / "cache")
    resolved = resolve_model("Someone/Tiny", config, options)
    assert fetch(resolved).is_relative_to(tmp_path / "cache")
