"""Packed and directory forms carry the same signed body and bytes, and both load."""

from __future__ import annotations

import os

import pytest
import torch

from flare.errors import PreparationError, UsageError
from flare.package import format as fmt
from flare.package.convert import convert
from flare.package.reader import open_package
from flare.package.trust import TrustOptions
from flare.package.verify import IntegrityError


def _full(approved):
    return TrustOptions(approve_key=approved.approve_key, accept_publisher=approved.accept_publisher,
                        offline=True, verify_weights=True)


def test_packed_and_directory_round_trip_and_load(export, approved, tmp_path):
    entry = export()
    packed = convert(entry, tmp_path / "model.safetensors", "packed")
    directory = convert(packed, tmp_path / "unpacked", "directory")
    original = open_package(entry, _full(approved))
    reference = dict(original.iter_weights())
    for target in (packed, directory):
        package = open_package(target, _full(approved))
        assert package.files.primary.manifest_body == original.files.primary.manifest_body
        assert package.files.primary.signature == original.files.primary.signature
        for pinned in (False, True):              # mapped, and read into staging buffers as for a GPU
            weights = {name: tensor.clone() for name, tensor in package.iter_weights(pinned=pinned)}
            assert sorted(weights) == sorted(reference)
            assert all(torch.equal(weights[name], reference[name]) for name in reference)
        assert package.frontend_assets == original.frontend_assets
    assert open_package(packed, approved).form == "packed"
    for record in original.payloads:
        assert (directory / record.name).read_bytes() == (entry / record.name).read_bytes()


def test_directory_on_the_same_filesystem_shares_inodes(export, tmp_path):
    entry = export()
    copy = convert(entry, tmp_path / "copy", "directory")
    for payload in (entry / "weights").iterdir():
        assert os.stat(payload).st_ino == os.stat(copy / "weights" / payload.name).st_ino


def test_convert_refuses_an_existing_destination(export, tmp_path):
    entry = export()
    (tmp_path / "taken").mkdir()
    with pytest.raises(UsageError, match="already exists"):
        convert(entry, tmp_path / "taken", "packed")


def test_a_corrupt_payload_in_a_packed_file_is_caught(export, approved, tmp_path):
    packed = convert(export(), tmp_path / "model.safetensors", "packed")
    location = fmt.read_package_files(packed).packed_locations["weights/layer-001.safetensors"]
    with open(packed, "r+b") as handle:
        handle.seek(location.offset + location.size - 1)
        handle.write(b"\x7f")
    with pytest.raises(IntegrityError, match="payload weights/layer-001.safetensors is corrupt"):
        open_package(packed, _full(approved))
    with pytest.raises(IntegrityError, match="weights/layer-001.safetensors differs"):
        convert(packed, tmp_path / "again", "directory")
    assert not (tmp_path / "again").exists()


def test_a_truncated_packed_file_is_caught(export, approved, tmp_path):
    packed = convert(export(), tmp_path / "model.safetensors", "packed")
    os.truncate(packed, packed.stat().st_size - 100)
    with pytest.raises(PreparationError, match="truncated"):
        open_package(packed, approved)


def test_ignition_convert_command(export, tmp_path, capsys):
    from flare.cli.ignition import main
    entry = export()
    assert main(["convert", str(entry), "--form", "packed", "--output", str(tmp_path / "p.safetensors")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "p.safetensors")
    assert main(["convert", str(entry), "--output", str(tmp_path / "p.safetensors")]) == 2


def test_ignition_convert_names_the_output_after_the_entry(export, tmp_path, monkeypatch, capsys):
    from flare.cli.ignition import main
    entry = export()
    monkeypatch.chdir(tmp_path)
    assert main(["convert", str(entry), "--form", "packed"]) == 0
    written = tmp_path / f"stories260k-{entry.name}.safetensors"
    assert capsys.readouterr().out.strip() == written.name and written.is_file()


def test_directory_on_another_filesystem_is_copied(export, approved, tmp_path):
    import tempfile
    from pathlib import Path
    shm = Path("/dev/shm")
    if not shm.is_dir() or shm.stat().st_dev == tmp_path.stat().st_dev:
        pytest.skip("no second filesystem here")
    entry = export()
    with tempfile.TemporaryDirectory(dir=shm) as elsewhere:
        copy = convert(entry, Path(elsewhere) / "copy", "directory")
        for payload in (entry / "weights").iterdir():
            twin = copy / "weights" / payload.name
            assert twin.stat().st_nlink == 1 and twin.read_bytes() == payload.read_bytes()
        assert len(list(open_package(copy, approved).iter_weights())) == 47
