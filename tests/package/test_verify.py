"""Any changed byte, in a payload or in the signed manifest, stops the load with an error naming it."""

from __future__ import annotations

import base64
import json
import os
import struct

import pytest

from flare.errors import PreparationError
from flare.package import format as fmt
from flare.package import safetensors_io as st
from flare.package.manifest import canonical_text
from flare.package.reader import open_package
from flare.package.trust import SignatureError, TrustOptions
from flare.package.verify import IntegrityError


def _flip(path, offset):
    os.chmod(path, 0o644)                       # blobs are read-only; a tamperer would not care
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 0x01]))


def _payloads(entry):
    return json.loads(fmt.read_package_files(entry).primary.manifest_body)["payloads"]


def test_a_flipped_byte_in_any_payload_is_named(export, approved):
    entry = export()
    verify_all = TrustOptions(approve_key=approved.approve_key, accept_publisher=approved.accept_publisher,
                              verify_weights=True, offline=True)
    open_package(entry, verify_all)
    for record in _payloads(entry):
        path = entry / record["name"]
        offset = record["size"] - 1                  # the last data byte
        _flip(path, offset)
        with pytest.raises(IntegrityError, match=f"payload {record['name']} is corrupt"):
            open_package(entry, verify_all)
        _flip(path, offset)
    open_package(entry, verify_all)


def test_frontend_and_graph_payloads_are_hashed_on_every_load(export, approved):
    entry = export()
    for name in ("frontend.safetensors", "deployments/tp1/rank-0/graphs.safetensors"):
        record = next(r for r in _payloads(entry) if r["name"] == name)
        _flip(entry / name, record["size"] - 2)
        with pytest.raises(IntegrityError, match=f"payload {name} is corrupt"):
            open_package(entry, approved)
        _flip(entry / name, record["size"] - 2)


def test_a_truncated_payload_is_named_without_hashing(export, approved):
    entry = export()
    path = entry / "weights/layer-003.safetensors"
    os.chmod(path, 0o644)
    size = path.stat().st_size
    os.truncate(path, size - 10)
    with pytest.raises(IntegrityError, match=r"payload weights/layer-003.safetensors is truncated: "
                                             rf"{size - 10} bytes, the signed manifest records {size}"):
        open_package(entry, approved)


def test_a_missing_payload_is_named(export, approved):
    entry = export()
    (entry / "weights/head.safetensors").unlink()
    with pytest.raises(IntegrityError, match="payload weights/head.safetensors is missing"):
        open_package(entry, approved)


def test_a_flipped_byte_in_the_manifest_breaks_the_signature(export, approved):
    entry = export()
    primary = entry / "model.safetensors"
    data = primary.read_bytes()
    # change one character inside the manifest's plan without breaking the JSON around it
    marker = b'\\"max_concurrency\\":4'
    index = data.index(marker) + len(marker) - 1
    os.chmod(primary, 0o644)
    primary.write_bytes(data[:index] + b"5" + data[index + 1:])
    with pytest.raises(SignatureError, match="the manifest signature does not verify"):
        open_package(entry, approved)


def test_a_corrupt_primary_header_is_reported(export, approved):
    entry = export()
    primary = entry / "model.safetensors"
    data = primary.read_bytes()
    os.chmod(primary, 0o644)
    primary.write_bytes(struct.pack("<Q", 10 ** 12) + data[8:])
    with pytest.raises(PreparationError, match="header length"):
        open_package(entry, approved)


def test_verify_weights_reports_byte_progress(export, approved):
    entry = export()
    seen = []
    options = TrustOptions(approve_key=approved.approve_key, accept_publisher=approved.accept_publisher,
                           verify_weights=True, offline=True)
    open_package(entry, options, on_verify_bytes=seen.append)
    weights = sum(r["size"] for r in _payloads(entry) if r["kind"] == "weights")
    assert sum(seen) == weights


def test_a_signed_manifest_cannot_name_a_path_outside_its_entry(export, approved, tmp_path):
    from flare.package.convert import convert
    from flare.package.signing import config_dir_for, development_identity
    entry = export()
    files = fmt.read_package_files(entry)
    manifest = json.loads(files.primary.manifest_body)
    manifest["payloads"][0]["name"] = "../../escaped.safetensors"
    body = canonical_text(manifest)
    identity = development_identity(config_dir_for(None))          # validly signed, still refused
    primary = entry / "model.safetensors"
    primary.chmod(0o644)
    primary.unlink()
    signature = base64.b64encode(identity.sign(body.encode())).decode()
    st.write(primary, [], {fmt.KEY_FORMAT: "2", fmt.KEY_FORM: "directory", fmt.KEY_MANIFEST: body,
                           fmt.KEY_SIGNATURE: signature, fmt.KEY_PROFILE: identity.profile.to_json()})
    with pytest.raises(PreparationError, match="not a plain relative path"):
        open_package(entry, approved)
    with pytest.raises(PreparationError, match="not a plain relative path"):
        convert(entry, tmp_path / "out", "directory")
    assert not (tmp_path / "out").exists() and not (entry.parent.parent / "escaped.safetensors").exists()
