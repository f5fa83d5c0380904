"""Export refuses what would fail later: weights the model cannot take (loaded through the model on a
CPU too), reused payloads that differ from what this export writes, and an official source outside the
publisher's namespace."""

from __future__ import annotations

import base64
import json
import shutil
from dataclasses import replace

import pytest

from flare.config import PublishingConfig
from flare.errors import PreparationError, UsageError
from flare.package import format as fmt
from flare.package import safetensors_io as st
from flare.package import weights as wt
from flare.package.manifest import canonical_text
from flare.package.signing import check_official_source, config_dir_for, development_identity, publishing_identity
from flare.package.store import ModelCache

TENSOR = "model.layers.2.mlp.up_proj.weight"


def _checkpoint_with(stories260k, tmp_path, change):
    """A copy of stories260k whose tensor TENSOR went through `change`."""
    from safetensors.torch import load_file, save_file
    copy = tmp_path / "checkpoint"
    shutil.copytree(stories260k, copy, ignore=shutil.ignore_patterns("reference"))
    tensors = load_file(copy / "model.safetensors")
    tensors[TENSOR] = change(tensors[TENSOR])
    save_file(tensors, copy / "model.safetensors", metadata={"format": "pt"})
    return copy


def test_a_cpu_export_of_a_wrong_shaped_tensor_fails_with_exit_5_naming_it(stories260k, tmp_path, capsys):
    from flare.cli.ignition import main
    checkpoint = _checkpoint_with(stories260k, tmp_path, lambda tensor: tensor[:-1].clone())   # 171 rows, not 172
    config = tmp_path / "config.toml"
    config.write_text(f'[paths]\npackage_cache = "{tmp_path / "cache"}"\n')
    assert main(["export", str(checkpoint), "--config", str(config)]) == 5
    err = capsys.readouterr().err
    assert TENSOR in err and "Traceback" not in err
    assert ModelCache(tmp_path / "cache").entries() == []


def test_reuse_weights_refuses_payloads_that_differ_from_what_this_export_writes(export, monkeypatch):
    """The cached version's payloads hold float32 where this export would now store float16 (as when a
    newer Flare stores a tensor differently): reuse names the tensor instead of linking the old bytes."""
    export()
    real = wt.stored_dtype
    monkeypatch.setattr(wt, "stored_dtype", lambda name, dtype: "float16" if name == TENSOR else real(name, dtype))
    with pytest.raises(PreparationError, match=rf"weights/layer-002.safetensors of the cached default version "
                                               rf"stories260k@\S+ holds {TENSOR} as F32 \[172, 64\] .* this export "
                                               rf"writes {TENSOR} as F16 \[172, 64\]"):
        export(weight_mode="reuse-weights")


def test_reuse_weights_refuses_a_cached_version_without_tensor_lists(export):
    entry = export()
    files = fmt.read_package_files(entry)
    fields = json.loads(files.primary.manifest_body)
    for record in fields["payloads"]:                   # as packages exported before tensor lists were signed
        record.pop("tensors", None)
        record.pop("sample", None)
    body = canonical_text(fields)
    identity = development_identity(config_dir_for(None))
    primary = entry / fmt.PRIMARY_NAME
    primary.chmod(0o644)
    primary.unlink()
    st.write(primary, [], dict(files.primary.metadata(), **{
        fmt.KEY_MANIFEST: body, fmt.KEY_SIGNATURE: base64.b64encode(identity.sign(body.encode())).decode()}))
    with pytest.raises(PreparationError, match="records no tensor list for weights/embed.safetensors"):
        export(weight_mode="reuse-weights")


def test_the_official_source_must_be_a_repository_under_the_publisher_namespace(tmp_path):
    check_official_source("https://huggingface.co/example/stories", "example", "--official-source")
    with pytest.raises(UsageError, match="is under 'someone-else', not the publisher namespace 'example'"):
        check_official_source("https://huggingface.co/someone-else/stories", "example", "--official-source")
    with pytest.raises(UsageError, match="not a repository URL"):
        check_official_source("https://huggingface.co/example", "example", "[publishing] official_source")
    from flare.package.signing import generate_private_key, private_key_pem, write_owner_only
    write_owner_only(tmp_path / "key.pem", private_key_pem(generate_private_key(), None))
    publishing = PublishingConfig(signing_key=tmp_path / "key.pem", namespace="example",
                                  official_source="https://huggingface.co/example/stories")
    assert publishing_identity(publishing, tmp_path).official_source == "https://huggingface.co/example/stories"
    with pytest.raises(UsageError, match=r"--official-source https://huggingface.co/other/stories is under 'other'"):
        publishing_identity(publishing, tmp_path, official_source="https://huggingface.co/other/stories")
    with pytest.raises(UsageError, match=r"\[publishing\] official_source https://huggingface.co/other/m is under"):
        publishing_identity(replace(publishing, official_source="https://huggingface.co/other/m"), tmp_path)


def test_keygen_refuses_an_official_source_outside_its_namespace(tmp_path):
    from flare.package.keys import keygen
    (tmp_path / "pass").write_text("a passphrase\n")
    with pytest.raises(UsageError, match="not the publisher namespace 'example'"):
        keygen(tmp_path / "key.pem", "example", "https://huggingface.co/other/m", tmp_path / "pass")
    assert not (tmp_path / "key.pem").exists()
