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
from flare.package import weights as wt
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
    assert package.plan.dtype == "bfloat16"


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


CPU_ONLY = pytest.mark.skipif(torch.cuda.is_available(), reason="describes preparation on a host without a GPU")


@CPU_ONLY
def test_gpus_without_a_gpu_is_a_usage_error(export):
    with pytest.raises(UsageError, match="no CUDA GPU is visible"):
        export(gpus="0")


@CPU_ONLY
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


def test_concurrent_exports_publish_distinct_versions(export, cache_root):
    import threading
    results, errors = [], []

    def run():
        try:
            results.append(export())
        except Exception as error:                  # noqa: BLE001 - reported below
            errors.append(error)

    threads = [threading.Thread(target=run) for _ in range(3)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == [] and len(set(results)) == 3
    assert len(ModelCache(cache_root).entries()) == 3


@CPU_ONLY
def test_a_model_that_cannot_fit_fails_before_loading_weights(export, cache_root, monkeypatch):
    from flare.errors import CapacityError
    from flare.memory import DeviceMemory
    small = DeviceMemory(index=0, name="host memory", free=600 * 2 ** 20, total=2 ** 30, host=True)
    monkeypatch.setattr("flare.memory.read_host_memory", lambda: small)
    with pytest.raises(CapacityError, match=r"(?s)needs .* weights \+ .* graphs .*;\s+has .* free host memory"):
        export()
    assert not (cache_root / "staging").exists() or list((cache_root / "staging").iterdir()) == []
    assert ModelCache(cache_root).entries() == []


def test_a_full_disk_is_a_preparation_error_and_publishes_nothing(export, cache_root, monkeypatch):
    import errno as errno_codes

    real_write, written = st.write, []

    def write_until_full(path, tensors, metadata=None):
        if written:
            raise OSError(errno_codes.ENOSPC, "No space left on device")
        written.append(path)
        return real_write(path, tensors, metadata)

    monkeypatch.setattr(st, "write", write_until_full)
    with pytest.raises(PreparationError, match=r"model cache .* is full \(no space left on device.*flare models gc"):
        export()
    assert not (cache_root / "refs" / "stories260k").exists()
    assert not (cache_root / "models" / "stories260k").exists() or not any((cache_root / "models" / "stories260k").iterdir())


def test_a_configured_export_staging_is_refused_not_silently_ignored(export, cache_root, tmp_path):
    config = tmp_path / "config.toml"
    config.write_text(f'[paths]\nexport_staging = "{tmp_path / "nas-staging"}"\n')
    with pytest.raises(UsageError, match="paths.export_staging = .* is not supported yet"):
        export(config_path=config)
    assert not (tmp_path / "nas-staging").exists() and not (cache_root / "refs").exists()


def test_a_failed_payload_stops_the_remaining_writes(export, monkeypatch):
    import threading

    real_read, started = wt.read_checkpoint_group, []
    lock = threading.Lock()

    def read_or_fail(names, files, dtype, online_fp8=None):
        with lock:
            started.append(names[0])
            first = len(started) == 1
        if first:
            raise PreparationError("checkpoint tensor is corrupt")
        return real_read(names, files, dtype, online_fp8)

    monkeypatch.setattr(wt, "read_checkpoint_group", read_or_fail)
    monkeypatch.setattr("flare.package.export.WRITE_WORKERS", 1)
    with pytest.raises(PreparationError, match="corrupt"):
        export()
    # The one worker reads nothing after the failure: the payloads queued behind it were never read.
    assert len(started) == 1
