"""flare download: a published package from a hub repository (the loopback hub) into the Flare model cache."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))      # tests/, for the shared hub server
from hub_server import TEST_TOKEN, hub  # noqa: E402,F401  (hub is a fixture)

from flare.cli.flare import main  # noqa: E402
from flare.config import load_config  # noqa: E402
from flare.errors import FetchError, PreparationError, UsageError  # noqa: E402
from flare.package import format as fmt  # noqa: E402
from flare.package.convert import convert  # noqa: E402
from flare.package.download import DownloadOptions, download, resolve_package_target, select_primary  # noqa: E402
from flare.package.reader import open_package  # noqa: E402
from flare.package.sources import SourceRecords  # noqa: E402
from flare.package.store import ModelCache, model_key_for, sha256_file  # noqa: E402
from flare.package.trust import TrustOptions  # noqa: E402

REPO = "Acme/Stories-Flare"


@pytest.fixture
def flare_cache(tmp_path) -> Path:
    """The downloading side's model cache; the publisher exports into its own (`cache_root`)."""
    return tmp_path / "flare-cache"


@pytest.fixture
def config_file(hub, tmp_path) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(f'[hub]\nendpoint = "{hub.url}"\n')
    return path


@pytest.fixture
def options(config_file, flare_cache) -> DownloadOptions:
    return DownloadOptions(config=load_config(config_file), model_cache=flare_cache)


@pytest.fixture
def upload(export, tmp_path):
    """Export stories260k and convert it into a directory to upload as-is; returns a function."""
    def make(name: str = "upload", form: str = "directory") -> Path:
        entry = export()
        folder = tmp_path / name
        if form == "packed":
            folder.mkdir()
            convert(entry, folder / "stories260k.safetensors", "packed")
        else:
            convert(entry, folder, "directory")
        return folder
    return make


def flare(*argv, config_file, flare_cache) -> int:
    return main([*argv, "--config", str(config_file), "--model-cache", str(flare_cache)])


def full_check(approved) -> TrustOptions:
    return TrustOptions(approve_key=approved.approve_key, accept_publisher=approved.accept_publisher,
                        offline=True, verify_weights=True)


def test_download_installs_a_verified_selected_entry_and_prints_only_its_path(
        hub, upload, config_file, flare_cache, approved, capsys):
    commit = hub.add_commit(REPO, upload())
    assert flare("download", REPO, config_file=config_file, flare_cache=flare_cache) == 0
    out, err = capsys.readouterr()
    entry = Path(out.strip())
    assert out == f"{entry}\n"
    assert "default branch main" in err and commit in err
    cache = ModelCache(flare_cache)
    assert entry.parent.parent == cache.models and cache.default_version(entry.parent.name) == entry.name
    with open_package(entry, full_check(approved)) as package:
        assert package.label == f"stories260k@{entry.name}"
        assert len(list(package.iter_weights())) == 47
        for record in package.payloads:                   # payloads are hard links to content-addressed blobs
            assert os.stat(entry / record.name).st_ino == os.stat(cache.blob_path(record.sha256)).st_ino
    [record] = SourceRecords(cache).records(REPO)
    assert (record.commit, record.filename, record.requested_revision) == (commit, "model.safetensors", "main")
    assert record.envelope_sha256 == sha256_file(entry / fmt.PRIMARY_NAME)
    assert SourceRecords(cache).origin_of_path(entry) == record
    assert not any((flare_cache / "transport").rglob("*Stories-Flare*"))      # transport files are temporary


def test_models_download_is_the_same_command(hub, upload, config_file, flare_cache, capsys):
    hub.add_commit(REPO, upload())
    assert main(["models", "--config", str(config_file), "--model-cache", str(flare_cache), "download", REPO]) == 0
    first = capsys.readouterr().out
    assert flare("download", REPO, config_file=config_file, flare_cache=flare_cache) == 0
    assert capsys.readouterr().out == first


def test_download_does_not_grant_publisher_trust(hub, upload, options, tmp_path):
    hub.add_commit(REPO, upload())
    entry = download(REPO, options, stream=open(os.devnull, "w"))
    assert not (Path.home() / ".config" / "flare" / "trust.toml").exists()
    from flare.package.trust import TrustError
    with pytest.raises(TrustError, match="not accepted"):
        open_package(entry, TrustOptions(offline=True, interactive=False))


def test_redownloading_an_unchanged_commit_transfers_nothing(hub, upload, options, flare_cache):
    hub.add_commit(REPO, upload())
    first = download(REPO, options)
    hub.clear_log()
    assert download(REPO, options) == first
    assert hub.bodies_served == []


def test_payloads_already_cached_are_linked_not_downloaded(hub, upload, options, flare_cache):
    hub.add_commit(REPO, upload())
    first = download(REPO, options)
    ModelCache(flare_cache).remove(ModelCache(flare_cache).entry_for_path(first), clear_default=True)
    (flare_cache / "sources").joinpath(os.listdir(flare_cache / "sources")[0]).unlink()
    hub.clear_log()
    assert download(REPO, options) == first                # blobs outlive the removed entry until gc
    assert hub.bodies_served == ["model.safetensors"]


def test_a_cached_payload_object_of_the_wrong_size_is_an_error(hub, upload, options, flare_cache, capsys):
    hub.add_commit(REPO, upload())
    cache = ModelCache(flare_cache)
    first = download(REPO, options)
    cache.remove(cache.entry_for_path(first), clear_default=True)
    (flare_cache / "sources").joinpath(os.listdir(flare_cache / "sources")[0]).unlink()
    blob = next(cache.blobs.iterdir())
    os.chmod(blob, 0o644)
    blob.write_bytes(blob.read_bytes()[:-1])
    with pytest.raises(PreparationError, match="bytes, but payload"):
        download(REPO, options)
    assert cache.entries() == []


def test_offline_resolves_only_recorded_downloads_without_requests(hub, upload, config_file, flare_cache, capsys):
    hub.add_commit(REPO, upload())
    assert flare("download", REPO, "--offline", config_file=config_file, flare_cache=flare_cache) == 3
    assert "no recorded download" in capsys.readouterr().err
    assert hub.requests == []
    assert flare("download", REPO, config_file=config_file, flare_cache=flare_cache) == 0
    online = capsys.readouterr().out
    hub.clear_log()
    assert flare("download", REPO, "--offline", config_file=config_file, flare_cache=flare_cache) == 0
    assert capsys.readouterr().out == online
    assert hub.requests == []
    assert flare("download", REPO, "--offline", "--filename", "model.safetensors",
                 config_file=config_file, flare_cache=flare_cache) == 3   # only an automatic selection was recorded


def test_offline_refuses_an_entry_whose_envelope_changed(hub, upload, options, flare_cache, tmp_path):
    hub.add_commit(REPO, upload())
    entry = download(REPO, options)
    primary = entry / fmt.PRIMARY_NAME
    replacement = tmp_path / "other"
    replacement.write_bytes(primary.read_bytes() + b" ")     # still a valid primary, but not the one acquired
    os.replace(replacement, primary)
    from dataclasses import replace
    with pytest.raises(PreparationError, match="differs from the signed envelope"):
        download(REPO, replace(options, offline=True))


def _flip_last_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x01
    path.write_bytes(bytes(data))


def _break_signature(path: Path) -> None:
    package = fmt.read_package_files(path)
    signature = bytearray(package.primary.signature)
    signature[0] ^= 0x01
    primary = fmt.Primary(package.primary.manifest_body, bytes(signature), package.primary.profile_json, "directory")
    os.unlink(path)
    fmt.write_primary(path, primary)


@pytest.mark.parametrize("tamper, message", [
    (lambda folder: _flip_last_byte(folder / "weights" / "layer-001.safetensors"), "differs from the signed manifest"),
    (lambda folder: _break_signature(folder / fmt.PRIMARY_NAME), "signature does not verify"),
])
def test_a_tampered_repository_is_rejected_and_nothing_is_installed(
        hub, upload, config_file, flare_cache, capsys, tamper, message):
    folder = upload()
    tamper(folder)
    hub.add_commit(REPO, folder)
    assert flare("download", REPO, config_file=config_file, flare_cache=flare_cache) == 3
    out, err = capsys.readouterr()
    assert out == "" and message in err
    cache = ModelCache(flare_cache)
    assert cache.entries() == []
    assert not any(cache.refs.glob("*")) and not any(cache.blobs.glob("*"))
    assert SourceRecords(cache).records(REPO) == []


def test_an_unknown_repository_is_a_fetch_error(hub, config_file, flare_cache, capsys):
    assert flare("download", "Nobody/Nothing", config_file=config_file, flare_cache=flare_cache) == 3
    assert "Nobody/Nothing" in capsys.readouterr().err


def test_an_unknown_revision_is_a_fetch_error(hub, upload, config_file, flare_cache, capsys):
    hub.add_commit(REPO, upload())
    assert flare("download", f"{REPO}@gb10", config_file=config_file, flare_cache=flare_cache) == 3
    assert "gb10" in capsys.readouterr().err


def test_explicit_revision_wins_and_pins_the_commit(hub, upload, options, flare_cache):
    old = hub.add_commit(REPO, upload("first"), refs=("main", "stable"))
    hub.add_commit(REPO, upload("second"))                  # main moves on; stable stays
    from dataclasses import replace
    entry = download(f"{REPO}@main", replace(options, revision="stable"))
    [record] = SourceRecords(ModelCache(flare_cache)).records(REPO)
    assert (record.requested_revision, record.commit) == ("stable", old)
    assert download(f"{REPO}@{old}", options) == entry


def test_a_private_repository_needs_the_token_file(hub, upload, config_file, flare_cache, tmp_path, capsys):
    hub.add_commit(REPO, upload(), private=True)
    assert flare("download", REPO, config_file=config_file, flare_cache=flare_cache) == 3
    capsys.readouterr()
    token = tmp_path / "token"
    token.write_text(TEST_TOKEN + "\n")
    assert flare("download", REPO, "--token-file", str(token), config_file=config_file, flare_cache=flare_cache) == 0


def test_a_packed_package_is_installed_in_directory_form(hub, upload, options, approved):
    hub.add_commit(REPO, upload(form="packed"))
    entry = download(REPO, options)
    with open_package(entry, full_check(approved)) as package:
        assert package.form == "directory" and len(list(package.iter_weights())) == 47


def test_a_transport_on_another_filesystem_is_copied(hub, upload, options, approved):
    import tempfile
    shm = Path("/dev/shm")
    if not shm.is_dir() or shm.stat().st_dev == options.cache_root.parent.stat().st_dev:
        pytest.skip("no second filesystem here")
    hub.add_commit(REPO, upload())
    from dataclasses import replace
    with tempfile.TemporaryDirectory(dir=shm) as elsewhere:
        entry = download(REPO, replace(options, cache_dir=Path(elsewhere)))
        assert not any(Path(elsewhere).rglob("*.safetensors"))
    with open_package(entry, full_check(approved)) as package:
        assert len(list(package.iter_weights())) == 47


def test_gpus_must_match_a_prepared_deployment(hub, upload, config_file, flare_cache, capsys):
    hub.add_commit(REPO, upload())
    assert flare("download", REPO, "--gpus", "0,1", config_file=config_file, flare_cache=flare_cache) == 2
    assert "tensor-parallel size 1" in capsys.readouterr().err
    assert flare("download", REPO, "--gpus", "0", config_file=config_file, flare_cache=flare_cache) == 0


# -- selecting the primary ------------------------------------------------------------------------------


def test_the_primary_is_the_sole_package_file():
    files = {"model.safetensors": 1, "frontend.safetensors": 1, "weights/layer-000.safetensors": 1,
             "deployments/tp1/rank-0/graphs.safetensors": 1, "a" * 64 + ".safetensors": 1,
             "model-data-01-of-02.safetensors": 1, "README.md": 1}
    assert select_primary(files, None, "repo") == "model.safetensors"


def test_several_package_files_need_filename():
    files = {"tp1/model.safetensors": 1, "tp2/model.safetensors": 1, "tp1/weights/layer-000.safetensors": 1}
    with pytest.raises(UsageError, match="tp1/model.safetensors, tp2/model.safetensors.*--filename"):
        select_primary(files, None, "repo")
    assert select_primary(files, "tp2/model.safetensors", "repo") == "tp2/model.safetensors"
    with pytest.raises(FetchError, match="no file tp3/model.safetensors"):
        select_primary(files, "tp3/model.safetensors", "repo")


def test_a_transformers_checkpoint_is_not_a_package():
    with pytest.raises(UsageError, match="Transformers checkpoint.*ignition export"):
        select_primary({"config.json": 1, "model.safetensors": 1, "tokenizer.json": 1}, None, "repo")


# -- what flare run serves ------------------------------------------------------------------------------


def test_run_targets_resolve_paths_cached_models_and_repositories(hub, upload, options, export, cache_root):
    from dataclasses import replace
    local = export()
    assert resolve_package_target(str(local), options) == local
    with pytest.raises(UsageError, match="--revision apply to repository downloads"):
        resolve_package_target(str(local), replace(options, revision="main"))
    with pytest.raises(UsageError, match="no package at"):
        resolve_package_target("./missing.safetensors", options)
    hub.add_commit(REPO, upload())
    entry = resolve_package_target(REPO, options)
    assert entry.parent.name == "stories260k"
    hub.clear_log()
    assert resolve_package_target("stories260k", options) == entry      # update check: unchanged commit
    assert hub.bodies_served == [] and hub.requests
    hub.clear_log()
    assert resolve_package_target("stories260k", replace(options, offline=True)) == entry
    assert resolve_package_target(f"stories260k@{entry.name}", options) == entry
    assert hub.requests == []
    with pytest.raises(UsageError, match="cannot override the explicit local version"):
        resolve_package_target(f"stories260k@{entry.name}", replace(options, revision="main"))
    with pytest.raises(UsageError, match="not a package path, a model"):
        resolve_package_target("no-such-model", options)


def test_run_switches_a_downloaded_default_to_a_verified_update(hub, upload, options, flare_cache):
    hub.add_commit(REPO, upload("first"))
    first = resolve_package_target(REPO, options)
    hub.add_commit(REPO, upload("second"))
    second = resolve_package_target("stories260k", options)
    assert second != first and ModelCache(flare_cache).default_version("stories260k") == second.name
    origin = SourceRecords(ModelCache(flare_cache)).origin_of_path(first)
    assert origin is not None and origin.repository == REPO        # the older entry keeps its origin
    third_folder = upload("third")
    _break_signature(third_folder / fmt.PRIMARY_NAME)
    hub.add_commit(REPO, third_folder)
    assert resolve_package_target("stories260k", options) == second     # a failed update keeps the default
    assert ModelCache(flare_cache).default_version("stories260k") == second.name


def test_an_update_naming_a_different_model_is_rejected(hub, upload, options, flare_cache, stories260k, tmp_path):
    import io

    from flare.prepare import CheckpointSource, ExportOptions, RecipeFacts, export_model
    from flare.ui.progress import PhaseProgress
    hub.add_commit(REPO, upload())
    first = resolve_package_target(REPO, options)
    other = export_model(CheckpointSource(stories260k), RecipeFacts(name="llama", model_id="other260k"),
                         ExportOptions(cache_root=tmp_path / "other-cache"), PhaseProgress(stream=io.StringIO()))
    convert(other, tmp_path / "other-upload", "directory")
    hub.add_commit(REPO, tmp_path / "other-upload")
    stream = io.StringIO()
    assert resolve_package_target("stories260k", options, stream) == first
    assert "now holds other260k" in stream.getvalue()
    assert not (flare_cache / "models" / "other260k").exists()


def test_a_locally_exported_model_never_looks_up_a_repository(hub, export, cache_root, config_file):
    local = export()
    options = DownloadOptions(config=load_config(config_file), model_cache=cache_root)
    assert resolve_package_target("stories260k", options) == local
    assert hub.requests == []
    assert SourceRecords(ModelCache(cache_root)).origin_of_path(local) is None
    from dataclasses import replace
    with pytest.raises(UsageError, match="exported locally"):
        resolve_package_target("stories260k", replace(options, revision="main"))


def test_download_help_imports_nothing_heavy():
    import subprocess
    check = ("import sys\nfrom flare.cli.flare import main\ncode = main(sys.argv[1:])\n"
             "sys.exit(10 if any(m in sys.modules for m in ('torch', 'huggingface_hub', 'cryptography')) else code)\n")
    for argv in (["download", "--help"], ["models", "download", "--help"]):
        result = subprocess.run([sys.executable, "-c", check, *argv], capture_output=True, text=True,
                                env={"PYTHONPATH": str(Path(__file__).resolve().parents[2] / "src"),
                                     "HOME": "/nonexistent"})
        assert result.returncode == 0, result.stderr
        assert "--revision" in result.stdout and "--token-file" in result.stdout


def test_flare_run_downloads_a_repository_and_leases_the_entry_while_serving(
        hub, upload, options, flare_cache, approved, monkeypatch):
    import io

    from flare.server import launch

    hub.add_commit(REPO, upload())
    served = {}

    def serve(model, listener, config, stages, stream, *rest):
        cache = ModelCache(flare_cache)
        served["entry"] = cache.entry_for_path(model.package_path)
        with pytest.raises(UsageError, match="in use by a running process"):
            cache.remove(served["entry"], clear_default=True)
        return 0

    monkeypatch.setattr(launch, "serve", serve)
    stream = io.StringIO()
    trust = TrustOptions(approve_key=approved.approve_key, accept_publisher=approved.accept_publisher)
    run = launch.RunOptions(target=REPO, trust=trust, config=options.config, download=options)
    assert launch.run_package(run, stream) == 0
    assert served["entry"] is not None and ModelCache(flare_cache).entry_path(served["entry"]).is_dir()
    assert f"downloaded from {REPO}, which is not its signed official source" in stream.getvalue()
    ModelCache(flare_cache).remove(served["entry"], clear_default=True)     # the lease ends with serving


def test_models_gc_reclaims_abandoned_transfers_and_records_of_removed_entries(
        hub, upload, config_file, flare_cache, capsys):
    import json

    hub.add_commit(REPO, upload())
    assert flare("download", REPO, config_file=config_file, flare_cache=flare_cache) == 0
    entry = Path(capsys.readouterr().out.strip())
    cache = ModelCache(flare_cache)
    transport = flare_cache / "transport"
    failed = transport / "models--Acme--Broken" / "blobs"          # what an interrupted download leaves
    failed.mkdir(parents=True)
    (failed / "partial").write_bytes(b"x" * 1000)
    running = transport / "models--Acme--Running" / "blobs"
    running.mkdir(parents=True)
    records = SourceRecords(cache)
    assert records.records(REPO)

    with cache.lock(f"download-{model_key_for('acme/running')}"):                  # a download in progress keeps its files
        assert main(["models", "gc", "--json", "--model-cache", str(flare_cache)]) == 0
    first = json.loads(capsys.readouterr().out)
    assert first["removed_transport"] == ["models--Acme--Broken"] and first["reclaimed_bytes"] >= 1000
    assert first["removed_source_records"] == [] and running.is_dir() and not failed.exists()

    main(["models", "remove", f"{entry.parent.name}@{entry.name}", "--clear-default", "--model-cache",
          str(flare_cache)])
    capsys.readouterr()
    assert main(["models", "gc", "--json", "--model-cache", str(flare_cache)]) == 0
    second = json.loads(capsys.readouterr().out)
    assert len(second["removed_source_records"]) == 1 and REPO in second["removed_source_records"][0]
    assert records.records(REPO) == [] and not records.path_for(REPO).exists()
