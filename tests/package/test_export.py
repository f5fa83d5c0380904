"""Export publishes a signed entry whose payloads are hard links to content-addressed blobs."""

from __future__ import annotations

import io
import json
import os

import pytest
import torch
from safetensors import safe_open

from flare.errors import PreparationError, UsageError
from flare.package import format as fmt
from flare.package import safetensors_io as st
from flare.package.reader import open_package
from flare.package.store import ModelCache


def test_entry_layout_and_primary_holds_only_metadata(export, cache_root):
    entry = export()
    assert entry.parent.parent == cache_root / "models"
    assert (cache_root / "refs" / "stories260k").read_text().strip() == entry.name
    assert list((cache_root / "staging").iterdir()) == []
    with open(entry / "model.safetensors", "rb") as handle:
        header = st.read_header(handle)
    assert header.tensors == ()
    manifest = json.loads(header.metadata[fmt.KEY_MANIFEST])
    names = [record["name"] for record in manifest["payloads"]]
    assert names[:7] == ["weights/embed.safetensors"] + [f"weights/layer-{i:03d}.safetensors" for i in range(5)] \
        + ["weights/head.safetensors"]
    assert "frontend.safetensors" in names and "deployments/tp1/rank-0/graphs.safetensors" in names
    for record in manifest["payloads"]:
        payload = entry / record["name"]
        blob = cache_root / "blobs" / f"{record['sha256']}.safetensors"
        assert os.stat(payload).st_ino == os.stat(blob).st_ino
        assert payload.stat().st_size == record["size"]
    assert manifest["plan"]["max_concurrency"] == 4 and manifest["plan"]["decode_capacities"] == [1, 2, 4]
    assert manifest["checkpoint"]["config"]["num_hidden_layers"] == 5
    assert manifest["publisher"]["namespace"] == "local-development"


def test_weights_keep_checkpoint_names_and_values(export, approved, stories260k):
    package = open_package(export(), approved)
    loaded = dict(package.iter_weights())
    with safe_open(str(stories260k / "model.safetensors"), framework="pt") as reference:
        assert sorted(loaded) == sorted(reference.keys())
        for name in reference.keys():
            assert torch.equal(loaded[name], reference.get_tensor(name)), name


def test_weights_cast_to_the_serving_dtype(export, approved):
    package = open_package(export(dtype="bfloat16"), approved)
    assert {tensor.dtype for _, tensor in package.iter_weights()} == {torch.bfloat16}
    assert package.plan["dtype"] == "bfloat16"


def test_frontend_assets_materialise_for_the_tokenizer(export, approved, stories260k):
    with open_package(export(), approved) as package:
        directory = package.frontend_dir()
        assert (directory / "tokenizer.json").read_bytes() == (stories260k / "tokenizer.json").read_bytes()
        assert json.loads((directory / "config.json").read_text())["vocab_size"] == 512
    assert not directory.exists()


def test_two_exports_share_blobs_by_inode(export, cache_root):
    first, second = export(), export()
    assert first != second
    blobs = list((cache_root / "blobs").iterdir())
    for payload in (first / "weights").iterdir():
        twin = second / "weights" / payload.name
        assert os.stat(payload).st_ino == os.stat(twin).st_ino
        assert os.stat(payload).st_nlink == 3                     # blob + two entries
    assert len(list((cache_root / "blobs").iterdir())) == len(blobs)
    assert (cache_root / "refs" / "stories260k").read_text().strip() == second.name


def test_no_weights_needs_cached_payloads(export):
    with pytest.raises(PreparationError, match="--no-weights: weight payload weights/embed"):
        export(weight_mode="no-weights")
    export()
    assert export(weight_mode="no-weights").is_dir()


def test_no_weights_with_a_new_dtype_fails_before_publishing(export, cache_root):
    export()
    with pytest.raises(PreparationError, match="is not cached"):
        export(weight_mode="no-weights", dtype="float16")
    assert len(ModelCache(cache_root).entries()) == 1


def test_reuse_weights_links_the_default_versions_payloads(export, approved):
    with pytest.raises(PreparationError, match="needs a cached default version"):
        export(weight_mode="reuse-weights")
    first = export()
    second = export(weight_mode="reuse-weights")
    for payload in (first / "weights").iterdir():
        assert os.stat(payload).st_ino == os.stat(second / "weights" / payload.name).st_ino
    assert len(list(open_package(second, approved).iter_weights())) == 47


def test_reuse_weights_refuses_an_incompatible_default(export):
    export()
    with pytest.raises(PreparationError, match="differs in dtype"):
        export(weight_mode="reuse-weights", dtype="bfloat16")


def test_plan_flags_are_validated(export):
    with pytest.raises(UsageError, match="multiple of 64"):
        export(prefill_chunk=100)
    with pytest.raises(UsageError, match="outside llama's range"):
        export(max_concurrency=17)
    with pytest.raises(UsageError, match="no CUDA GPU") if not torch.cuda.is_available() else pytest.raises(Exception):
        export(gpus="0")


def test_phases_print_counts_and_skip_reasons_on_cpu(export):
    stream = io.StringIO()
    export(stream=stream)
    text = stream.getvalue()
    for phase in ("Resolve model", "Select GPUs", "Load weights", "Tune kernels", "Compile forward",
                  "Allocate KV cache", "Capture graphs", "Export package"):
        assert f"{phase}. " in text
    assert "Load weights. [ OK ] 47 tensors in 7 layer payloads" in text
    assert "Capture graphs. [SKIP] CUDA graphs need a GPU" in text
    assert "9 payloads written, 0 reused" in text


def test_ignition_export_prints_the_entry_path(stories260k, tmp_path, capsys):
    from flare.cli.ignition import main
    config = tmp_path / "config.toml"
    config.write_text(f'[paths]\npackage_cache = "{tmp_path / "cache"}"\n')
    assert main(["export", str(stories260k), "--config", str(config)]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1 and out[0].startswith(str(tmp_path / "cache" / "models"))
    assert (tmp_path / "development-signing-key.pem").stat().st_mode & 0o777 == 0o600


def test_ignition_export_rejects_both_weight_flags(stories260k, capsys):
    from flare.cli.ignition import main
    assert main(["export", str(stories260k), "--no-weights", "--reuse-weights"]) == 2
    assert "not allowed with argument" in capsys.readouterr().err
