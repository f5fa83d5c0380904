"""flare.hub against a hub-compatible server on 127.0.0.1: the real huggingface_hub download code runs."""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
from hub_server import TEST_TOKEN, fake_commit, hub, write_checkpoint  # noqa: F401  (hub is a fixture)

from flare.config import Config, HubConfig, default_paths, load_config
from flare.errors import FetchError, UsageError
from flare.hub import (
    HubOptions,
    download_snapshot,
    find_complete_snapshot,
    read_repository,
    repo_folder_name,
    resolve_revision,
)

REPO = "Org/Tiny"


@pytest.fixture
def cache(tmp_path) -> Path:
    return tmp_path / "hub-cache"


@pytest.fixture
def options(hub, cache) -> HubOptions:
    return HubOptions(endpoint=hub.url, cache_dir=cache)


def publish(hub, tmp_path, repo_id=REPO, name="ckpt", **kwargs) -> str:
    checkpoint_kwargs = {k: kwargs.pop(k) for k in ("architecture", "shards", "shard_bytes", "extra") if k in kwargs}
    folder = write_checkpoint(tmp_path / f"{name}-{fake_commit()[:8]}", **checkpoint_kwargs)
    return hub.add_commit(repo_id, folder, **kwargs)


def snapshot_names(path: Path) -> list[str]:
    return sorted(p.relative_to(path).as_posix() for p in path.rglob("*") if p.is_file())


# -- reading metadata without tensors -------------------------------------------------------------------


def test_reads_config_and_single_file_size_without_downloading_tensors(hub, tmp_path, options):
    commit = publish(hub, tmp_path, shard_bytes=8192)
    metadata = read_repository(REPO, "main", options)
    assert metadata.revision == commit
    assert metadata.requested_revision == "main"
    assert metadata.hf_config["architectures"] == ["LlamaForCausalLM"]
    assert metadata.weights.files == ("model.safetensors",)
    [published] = tmp_path.glob("ckpt-*/model.safetensors")
    assert metadata.weights.total_bytes == published.stat().st_size
    assert hub.safetensors_bodies_served == []
    assert metadata.snapshot is None


def test_reads_the_index_of_a_sharded_repository_without_downloading_shards(hub, tmp_path, options):
    commit = publish(hub, tmp_path, shards=3, shard_bytes=4096)
    metadata = read_repository(REPO, commit, options)
    assert metadata.weights.total_bytes == 3 * 4096
    assert metadata.weights.files == tuple(f"model-0000{i}-of-00003.safetensors" for i in (1, 2, 3))
    assert hub.safetensors_bodies_served == []
    assert set(hub.bodies_served) == {"config.json", "model.safetensors.index.json"}


def test_no_revision_means_the_current_commit(hub, tmp_path, options):
    publish(hub, tmp_path)
    newest = publish(hub, tmp_path)
    metadata = read_repository(REPO, None, options)
    assert metadata.revision == newest
    assert metadata.requested_revision is None


def test_branch_and_tag_resolve_to_their_commit_and_a_commit_costs_no_request(hub, tmp_path, options):
    tagged = publish(hub, tmp_path, refs=("main", "v1"))
    latest = publish(hub, tmp_path, refs=("main",))
    assert resolve_revision(REPO, "v1", options) == tagged
    assert resolve_revision(REPO, "main", options) == latest
    hub.clear_log()
    assert resolve_revision(REPO, tagged, options) == tagged
    assert hub.requests == []


# -- snapshots ------------------------------------------------------------------------------------------


def test_downloads_a_complete_snapshot_of_the_exact_commit(hub, tmp_path, options, cache):
    pinned = publish(hub, tmp_path, shards=2)
    publish(hub, tmp_path)  # main moves on; the pinned commit must still be what arrives
    path = download_snapshot(REPO, pinned, options)
    assert path == cache / repo_folder_name(REPO) / "snapshots" / pinned
    assert snapshot_names(path) == [
        "config.json", "model-00001-of-00002.safetensors", "model-00002-of-00002.safetensors",
        "model.safetensors.index.json", "tokenizer.json"]


def test_skips_weights_in_formats_flare_does_not_load_and_copies_beside_the_index(hub, tmp_path, options):
    extra = {"pytorch_model.bin": b"x" * 64, "original/consolidated.pth": b"y", "consolidated.safetensors": b"z" * 64,
             "params.json": b"{}"}
    commit = publish(hub, tmp_path, shards=2, extra=extra)
    path = download_snapshot(REPO, commit, options)
    names = snapshot_names(path)
    assert "params.json" in names and "model-00002-of-00002.safetensors" in names
    for skipped in ("pytorch_model.bin", "original/consolidated.pth", "consolidated.safetensors"):
        assert skipped not in names
        assert skipped not in hub.bodies_served
    assert find_complete_snapshot(REPO, commit, options.cache_dir) == path


def test_a_complete_snapshot_is_reused_without_any_request(hub, tmp_path, options):
    commit = publish(hub, tmp_path)
    first = download_snapshot(REPO, commit, options)
    hub.clear_log()
    assert download_snapshot(REPO, commit, options) == first
    metadata = read_repository(REPO, commit, options)
    assert metadata.snapshot == first
    assert metadata.weights.files == ("model.safetensors",)
    assert hub.requests == []


def test_a_case_variant_cache_directory_is_reused(hub, tmp_path, options, cache):
    commit = publish(hub, tmp_path)
    variant = download_snapshot("org/tiny", commit, options)  # another tool cached it in lower case
    assert variant.parts[-3] == "models--org--tiny"
    hub.clear_log()
    assert download_snapshot(REPO, commit, options) == variant
    assert hub.requests == []
    assert not (cache / repo_folder_name(REPO)).exists()


def copy_repo_folder(cache: Path, source_id: str, target_id: str) -> Path:
    """Another casing of a cached repository, as a second tool would have written it (relative links copy)."""
    target = cache / repo_folder_name(target_id)
    shutil.copytree(cache / repo_folder_name(source_id), target, symlinks=True)
    return target


def test_a_complete_exact_case_snapshot_wins(hub, tmp_path, options, cache):
    commit = publish(hub, tmp_path)
    download_snapshot("org/tiny", commit, options)
    exact = copy_repo_folder(cache, "org/tiny", REPO)
    assert find_complete_snapshot(REPO, commit, cache) == exact / "snapshots" / commit
    assert find_complete_snapshot("org/tiny", commit, cache).parts[-3] == "models--org--tiny"


def test_an_incomplete_snapshot_does_not_hide_a_complete_case_variant(hub, tmp_path, options, cache):
    commit = publish(hub, tmp_path, shards=2)
    variant = download_snapshot("org/tiny", commit, options)
    exact = copy_repo_folder(cache, "org/tiny", REPO) / "snapshots" / commit
    (exact / "model-00002-of-00002.safetensors").unlink()  # an interrupted download
    hub.clear_log()
    assert download_snapshot(REPO, commit, options) == variant
    assert hub.requests == []


def test_an_incomplete_snapshot_is_completed_by_downloading(hub, tmp_path, options):
    commit = publish(hub, tmp_path, shards=2)
    read_repository(REPO, commit, options)  # leaves config.json and the index in the snapshot
    partial = options.cache_dir / repo_folder_name(REPO) / "snapshots" / commit
    assert snapshot_names(partial) == ["config.json", "model.safetensors.index.json"]
    assert find_complete_snapshot(REPO, commit, options.cache_dir) is None
    path = download_snapshot(REPO, commit, options)
    assert path == partial
    assert "model-00002-of-00002.safetensors" in snapshot_names(path)


def test_a_snapshot_missing_a_file_the_hub_listed_is_incomplete(hub, tmp_path, options):
    commit = publish(hub, tmp_path)
    path = download_snapshot(REPO, commit, options)
    (path / "tokenizer.json").unlink()
    assert find_complete_snapshot(REPO, commit, options.cache_dir) is None
    assert download_snapshot(REPO, commit, options) == path
    assert (path / "tokenizer.json").is_file()


def test_another_revision_is_never_substituted(hub, tmp_path, options):
    old = publish(hub, tmp_path)
    new = publish(hub, tmp_path)
    download_snapshot(REPO, old, options)
    offline = HubOptions(endpoint=hub.url, cache_dir=options.cache_dir, offline=True)
    hub.clear_log()
    with pytest.raises(FetchError, match=new):
        download_snapshot(REPO, new, offline)
    assert hub.requests == []
    path = download_snapshot(REPO, new, options)
    assert path.name == new


def test_offline_reads_only_complete_snapshots_and_sends_nothing(hub, tmp_path, options):
    commit = publish(hub, tmp_path)
    assert read_repository(REPO, "main", options).revision == commit
    download_snapshot(REPO, commit, options)
    offline = HubOptions(endpoint=hub.url, cache_dir=options.cache_dir, offline=True)
    hub.clear_log()
    assert read_repository(REPO, "main", offline).revision == commit  # refs/main recorded the branch
    assert read_repository(REPO, commit, offline).hf_config["model_type"] == "llama"
    with pytest.raises(FetchError):
        read_repository(REPO, "v2", offline)
    assert hub.requests == []


# -- failures -------------------------------------------------------------------------------------------


def closed_endpoint() -> str:
    """An address on 127.0.0.1 where nothing listens."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return f"http://127.0.0.1:{probe.getsockname()[1]}"


def test_an_unreachable_hub_is_a_fetch_error(tmp_path, cache):
    closed = HubOptions(endpoint=closed_endpoint(), cache_dir=cache)
    commit = "0" * 40
    with pytest.raises(FetchError, match=f"Org/Tiny@{commit}") as raised:
        read_repository(REPO, commit, closed)
    assert raised.value.exit_code == 3
    assert closed.endpoint in str(raised.value) and "unreachable" in str(raised.value)
    with pytest.raises(FetchError, match="Org/Tiny"):
        download_snapshot(REPO, commit, closed)


def test_a_missing_repository_or_revision_is_a_fetch_error(hub, tmp_path, options):
    publish(hub, tmp_path)
    with pytest.raises(FetchError, match="no repository Org/Missing") as raised:
        read_repository("Org/Missing", None, options)
    assert raised.value.exit_code == 3
    with pytest.raises(FetchError, match="no revision v9"):
        read_repository(REPO, "v9", options)
    with pytest.raises(FetchError, match="no revision"):
        download_snapshot(REPO, "f" * 40, options)


def test_a_private_repository_needs_the_token_file(hub, tmp_path, options, cache):
    commit = publish(hub, tmp_path, private=True)
    with pytest.raises(FetchError, match="token"):
        read_repository(REPO, commit, options)
    token_file = tmp_path / "token"
    token_file.write_text(TEST_TOKEN + "\n")
    config = _config(hub.url, cache, token_file)
    authorized = HubOptions.from_config(config)
    hub.clear_log()
    path = download_snapshot(REPO, commit, authorized)
    assert (path / "model.safetensors").is_file()
    hub_requests = [r for r in hub.requests if not r.path.startswith("/cdn/")]
    assert hub_requests and all(r.authorization == f"Bearer {TEST_TOKEN}" for r in hub_requests)


def test_a_wrong_token_is_a_fetch_error_naming_the_token(hub, tmp_path, options):
    commit = publish(hub, tmp_path)
    wrong = HubOptions(endpoint=hub.url, cache_dir=options.cache_dir, token="hf_wrong")
    with pytest.raises(FetchError, match="401.*token"):
        read_repository(REPO, commit, wrong)


def test_options_come_from_the_configuration_file(tmp_path):
    (tmp_path / "token").write_text(TEST_TOKEN)
    config_file = tmp_path / "config.toml"
    config_file.write_text(f'[hub]\nendpoint = "http://127.0.0.1:1234/"\ntoken_file = "{tmp_path / "token"}"\n'
                           f'[paths]\nhub_cache = "{tmp_path / "cache"}"\n')
    options = HubOptions.from_config(load_config(config_file))
    assert (options.endpoint, options.token) == ("http://127.0.0.1:1234", TEST_TOKEN)
    assert options.cache_dir == tmp_path / "cache"
    assert TEST_TOKEN not in repr(options)
    assert HubOptions.from_config(load_config(None)).cache_dir == Path.home() / ".cache" / "huggingface" / "hub"


def test_a_missing_or_empty_token_file_is_a_usage_error(tmp_path, cache):
    with pytest.raises(UsageError, match="cannot read the hub token file"):
        HubOptions.from_config(_config("http://127.0.0.1:9", cache, tmp_path / "absent"))
    (tmp_path / "empty").write_text("\n")
    with pytest.raises(UsageError, match="is empty"):
        HubOptions.from_config(_config("http://127.0.0.1:9", cache, tmp_path / "empty"))


# -- HF_* variables never decide ------------------------------------------------------------------------


def test_no_token_is_sent_without_a_token_file_even_with_hf_token_set(hub, tmp_path, options, monkeypatch):
    monkeypatch.setenv("HF_TOKEN", "hf_from_environment")
    commit = publish(hub, tmp_path)
    download_snapshot(REPO, commit, options)
    assert hub.requests and all(r.authorization is None for r in hub.requests)


def test_explicit_options_win_over_hf_variables_read_at_import(hub, tmp_path, cache):
    commit = publish(hub, tmp_path)
    env = {**os.environ, "HF_ENDPOINT": "http://bogus.invalid", "HF_HUB_OFFLINE": "1", "HF_TOKEN": "hf_env",
           "HF_HUB_CACHE": str(tmp_path / "env-cache"), "HF_HOME": str(tmp_path / "env-home"),
           "PYTHONPATH": str(Path(__file__).resolve().parents[1] / "src")}
    script = (
        "import sys; from pathlib import Path; import huggingface_hub\n"
        "from flare.hub import HubOptions, download_snapshot\n"
        f"options = HubOptions(endpoint={hub.url!r}, cache_dir=Path({str(cache)!r}))\n"
        f"print(download_snapshot({REPO!r}, {commit!r}, options))\n"
    )
    result = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert Path(result.stdout.strip()) == cache / repo_folder_name(REPO) / "snapshots" / commit
    assert not (tmp_path / "env-cache").exists()
    assert hub.requests and all(r.authorization is None for r in hub.requests)


def _config(endpoint: str, cache: Path, token_file: Path | None) -> Config:
    return Config(path=cache.parent / "config.toml", paths=replace(default_paths(), hub_cache=cache),
                  hub=HubConfig(endpoint=endpoint, token_file=token_file))
