"""What a new user reads in the first hour: served aliases that inspect and run accept, model lists that
fit 80 columns, plain output without boxes, fingerprints on one line, honest checkpoint labels, and a
trust prompt and acceptance that say what they do."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest

from flare.cli.flare import main as flare_main
from flare.prepare import CheckpointSource, ExportOptions, RecipeFacts, export_model
from flare.ui.progress import PhaseProgress

BOX_CHARACTERS = set("┌┐└┘│─")


@pytest.fixture
def aliased_export(stories260k, cache_root):
    """stories260k exported as `tiny-stories`, also served as the alias `stories` (as demo serves flare-demo)."""
    recipe = RecipeFacts(name="llama", model_id="tiny-stories", alias="stories",
                         served_names=("tiny-stories", "stories"), prefill_chunk=256, default_concurrency=4)
    return export_model(CheckpointSource(stories260k), recipe,
                        ExportOptions(cache_root=cache_root, dtype="float32"),
                        PhaseProgress(stream=io.StringIO(), styled=False))


@pytest.fixture
def cache_root(tmp_path) -> Path:
    return tmp_path / "cache"


def _out(capsys, *argv) -> str:
    assert flare_main([str(arg) for arg in argv]) == 0, capsys.readouterr().err
    return capsys.readouterr().out


def test_inspect_accepts_a_served_alias(aliased_export, cache_root, capsys):
    report = json.loads(_out(capsys, "inspect", "stories", "--model-cache", cache_root, "--json"))
    assert report["model"]["model_id"] == "tiny-stories" and report["model"]["version"] == aliased_export.name
    report = json.loads(_out(capsys, "inspect", f"stories@{aliased_export.name}", "--model-cache", cache_root,
                             "--json"))
    assert report["model"]["version"] == aliased_export.name


def test_run_resolves_a_served_alias_to_the_cached_entry(aliased_export, cache_root):
    from flare.config import load_config
    from flare.package.download import DownloadOptions, resolve_package_target

    options = DownloadOptions(config=load_config(None), model_cache=cache_root, offline=True)
    assert resolve_package_target("stories", options, stream=io.StringIO()) == aliased_export


def test_models_list_fits_80_columns_without_cutting_a_header_or_a_size(capsys, monkeypatch, tmp_path):
    from flare.package import listing

    version = {"version": "20261201T211429Z", "selected": True, "in_use": True, "publisher": "local-development",
               "deployments": [{"tensor_parallel": 1, "max_concurrency": 256}],
               "logical_bytes": 1044992, "disk_physical_bytes": 1044992, "shared_physical_bytes": 1044992,
               "reclaimable_bytes": 1044992}
    monkeypatch.setattr(listing, "list_models", lambda cache, model: {
        "models": [{"model_key": "llama-3.1-8b-instruct", "versions": [version, dict(version, selected=False)]}]})
    for plain in ((), ("--plain",)):
        text = _out(capsys, "models", "--model-cache", tmp_path, "list", *plain)
        assert max(len(line) for line in text.splitlines()) <= 80
        assert "reclaimable" in text and "1020.5 KiB" in text and "default, in use" in text
        assert ("TP1 × 256") in text
    assert not BOX_CHARACTERS & set(text)                  # --plain draws no boxes


def test_plain_inspection_draws_no_boxes(aliased_export, capsys):
    text = _out(capsys, "inspect", aliased_export, "--plain", "--all")
    assert not BOX_CHARACTERS & set(text)
    assert "Publisher" in text and "served names" in text
    assert all(line == line.rstrip() for line in text.splitlines())


def test_the_key_fingerprint_stays_on_one_line_in_80_columns(aliased_export, capsys):
    from flare.package.reader import open_unverified

    fingerprint = open_unverified(aliased_export).manifest.publisher.key_fingerprint
    text = _out(capsys, "inspect", aliased_export)
    assert any(fingerprint in line for line in text.splitlines())
    assert max(len(line) for line in text.splitlines()) == 80


def test_a_checkpoint_directory_is_labelled_by_its_architecture_not_a_recipe_title(stories260k):
    from flare.config import load_config
    from flare.resolve import resolve_model

    described = resolve_model(str(stories260k), load_config(None)).describe()
    assert "Llama 3.x" not in described
    assert "LlamaForCausalLM, served by the llama recipe" in described


def test_flag_approval_says_it_is_remembered(aliased_export, tmp_path):
    from flare.package import format as fmt
    from flare.package.reader import open_unverified
    from flare.package.trust import TrustOptions, authorize, verify_signature

    files = fmt.read_package_files(aliased_export)
    manifest = files.primary.manifest
    fingerprint = manifest.publisher.key_fingerprint
    store = tmp_path / "trust.toml"
    options = TrustOptions(approve_key=fingerprint, accept_publisher="local-development", trust_store=store,
                           offline=True)
    key, source = verify_signature(files.primary.manifest_body, files.primary.signature, manifest,
                                   files.primary.profile_json, options, str(files.primary_path))
    said = io.StringIO()
    authorize(manifest, key, source, options, said)
    assert f"remembered in {store}" in said.getvalue() and "--dangerously-approve-key" in said.getvalue()
    assert store.is_file()
    again = io.StringIO()
    authorize(manifest, key, source, TrustOptions(trust_store=store, offline=True), again)   # remembered now
    assert again.getvalue() == "" and open_unverified(aliased_export) is not None


def test_the_prompt_does_not_read_like_a_default(aliased_export, tmp_path, monkeypatch):
    from flare.errors import FlareError
    from flare.package import format as fmt
    from flare.package.trust import TrustOptions, authorize, verify_signature

    files = fmt.read_package_files(aliased_export)
    manifest = files.primary.manifest
    options = TrustOptions(trust_store=tmp_path / "trust.toml", offline=True, interactive=True)
    key, source = verify_signature(files.primary.manifest_body, files.primary.signature, manifest,
                                   files.primary.profile_json, options, str(files.primary_path))
    monkeypatch.setattr("sys.stdin", io.StringIO("\n"))                    # the user presses Enter
    shown = io.StringIO()
    with pytest.raises(FlareError, match="nothing was accepted"):
        authorize(manifest, key, source, options, shown)
    prompt = shown.getvalue().splitlines()[-1]
    assert "(local-development)" not in prompt
    assert "type the publisher namespace local-development exactly" in prompt


def test_export_with_no_model_uses_defaults_model_as_the_readme_says(stories260k, tmp_path, capsys):
    """The spec's rule, which the README states: no MODEL means defaults.model, and a usage error
    naming it (and the built-in demo) when it is unset."""
    from flare.cli.ignition import main as ignition_main

    assert ignition_main(["export"]) == 2
    err = capsys.readouterr().err
    assert "defaults.model is not set" in err and "demo" in err
    config = tmp_path / "config.toml"
    config.write_text(f'[defaults]\nmodel = "{stories260k}"\n')
    assert ignition_main(["export", "--config", str(config)]) == 0
    assert Path(capsys.readouterr().out.strip().splitlines()[-1]).is_dir()
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    assert "with no MODEL: defaults.model" in readme and "with no MODEL, preparation uses" not in readme
