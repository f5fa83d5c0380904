"""What every load checks of the stored bytes without --verify-weights (sizes, weight headers against
the signed tensor lists, sampled hashes, the primary's unsigned form bound to its file), what it says
it did not check, and what --verify-weights adds."""

from __future__ import annotations

import os
import shutil

import pytest

from flare.errors import PreparationError
from flare.package import format as fmt
from flare.package import safetensors_io as st
from flare.package import verify
from flare.package.reader import open_package
from flare.package.trust import TrustOptions
from flare.package.verify import IntegrityError, sampled_ranges

LAYER = "weights/layer-003.safetensors"


@pytest.fixture
def small_samples(monkeypatch):
    """Exports sample 4 blocks of 4 KiB per payload, so a layer payload (178 KiB) has unsampled bytes."""
    monkeypatch.setattr(verify, "SAMPLE_BLOCK_BYTES", 4096)
    monkeypatch.setattr(verify, "SAMPLE_BLOCKS", 4)


def _writable(path):
    """A payload file detached from its read-only blob, as a tamperer or a damaged disk would leave it."""
    data = path.read_bytes()
    path.unlink()
    path.write_bytes(data)
    return path


def _flip(path, offset):
    with open(path, "r+b") as handle:
        handle.seek(offset)
        byte = handle.read(1)
        handle.seek(offset)
        handle.write(bytes([byte[0] ^ 0x01]))


def _full(approved) -> TrustOptions:
    return TrustOptions(approve_key=approved.approve_key, accept_publisher=approved.accept_publisher,
                        offline=True, verify_weights=True)


def test_a_damaged_weight_header_is_the_exit_5_message(export, approved):
    entry = export()
    path = _writable(entry / LAYER)
    data = path.read_bytes()
    index = data.index(b'"shape"')
    path.write_bytes(data[:index + 1] + b"shapf" + data[index + 6:])      # the same length, no "shape" key
    with pytest.raises(PreparationError, match=rf"payload {LAYER} is corrupt: the header entry of tensor "
                                               r"'model.layers.3.\S+' has no valid shape") as refused:
        open_package(entry, approved)
    assert refused.value.exit_code == 5


def test_a_header_that_parses_but_differs_from_the_signed_tensor_list_is_refused(export, approved):
    """Two layer payloads of the same size swapped: every size matches, each header parses."""
    entry = export()
    first, second = _writable(entry / "weights/layer-001.safetensors"), _writable(entry / "weights/layer-002.safetensors")
    data = first.read_bytes()
    shutil.copyfile(second, first)
    second.write_bytes(data)
    with pytest.raises(IntegrityError, match=r"payload weights/layer-001.safetensors is corrupt: its header's "
                                             r"tensors \(model.layers.2.\S+ F32 .* where the manifest has "
                                             r"model.layers.1."):
        open_package(entry, approved)


def test_a_flipped_data_byte_in_a_sampled_block_is_caught_by_default(export, approved, small_samples):
    entry = export()
    record = next(r for r in fmt.read_package_files(entry).manifest.payloads if r.name == LAYER)
    assert record.sample is not None and record.sample.blocks == 4
    start, end = sampled_ranges(record.size, 4096, 4)[2]
    _flip(_writable(entry / LAYER), start + 100)
    with pytest.raises(IntegrityError, match=f"payload {LAYER} is corrupt: the SHA-256 of its sampled blocks"):
        open_package(entry, approved)


def test_a_flipped_byte_outside_the_samples_is_reported_unchecked_and_caught_by_verify_weights(
        export, approved, small_samples):
    entry = export()
    record = next(r for r in fmt.read_package_files(entry).manifest.payloads if r.name == LAYER)
    (_, first_end), (second_start, _) = sampled_ranges(record.size, 4096, 4)[:2]
    _flip(_writable(entry / LAYER), (first_end + second_start) // 2)
    package = open_package(entry, approved)                 # the default open cannot see it, and says so
    checked = package.stored_data
    assert not checked.weights_hashed and checked.sampled == checked.weight_payloads == 7
    assert checked.sampled_bytes < checked.weight_bytes
    assert any("outside the sampled blocks" in line and "--verify-weights" in line for line in checked.not_checked())
    with pytest.raises(IntegrityError, match=f"payload {LAYER} is corrupt: its SHA-256 is"):
        open_package(entry, _full(approved))


def test_a_truncated_payload_padded_back_to_its_size_is_caught_by_its_last_sampled_block(
        export, approved, small_samples):
    entry = export()
    path = _writable(entry / LAYER)
    size = path.stat().st_size
    os.truncate(path, size - 1000)
    with pytest.raises(IntegrityError, match=f"payload {LAYER} is truncated"):
        open_package(entry, approved)
    os.truncate(path, size)                                  # zeros where the data was: the size matches again
    with pytest.raises(IntegrityError, match="the SHA-256 of its sampled blocks"):
        open_package(entry, approved)


def _rewrite_primary(entry, form: str) -> None:
    primary = entry / fmt.PRIMARY_NAME
    files = fmt.read_package_files(entry)
    primary.chmod(0o644)
    primary.unlink()
    st.write(primary, [], dict(files.primary.metadata(), **{fmt.KEY_FORM: form}))


@pytest.mark.parametrize("form, says", [("packed", "says 'packed', but the file holds no payloads"),
                                        ("zip", "is 'zip', not one of directory, packed")])
def test_the_unsigned_form_of_a_directory_primary_is_bound_to_its_file(export, approved, form, says):
    entry = export()
    _rewrite_primary(entry, form)
    with pytest.raises(PreparationError, match=f"flare.form {says}"):
        open_package(entry, approved)


def test_a_packed_file_relabelled_as_a_directory_primary_is_refused(export, approved, tmp_path):
    """Relabelled, it would read its payloads from whatever files lay beside it."""
    import json
    import struct

    from flare.package.convert import convert
    packed = convert(export(), tmp_path / "stories.safetensors", "packed")
    data = packed.read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    fields = json.loads(data[8:8 + length])
    fields["__metadata__"][fmt.KEY_FORM] = "directory"
    text = json.dumps(fields, separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    packed.write_bytes(struct.pack("<Q", len(text)) + text + data[8 + length:])   # offsets are data-relative
    with pytest.raises(PreparationError, match=r"flare.form says 'directory', but the file holds \d+ tensors"):
        open_package(packed, approved)


def test_the_report_says_what_every_load_checked(export, approved):
    package = open_package(export(), approved)
    checked = package.stored_data
    assert checked.payloads == 9 and checked.hashed_small == 2 and checked.headers_recorded == 7
    lines = checked.checked()
    assert lines[0] == "sizes of all 9 payloads"
    assert "safetensors headers of 7 weight payloads against the signed tensor lists" in lines
    full = open_package(package.path, _full(approved)).stored_data
    assert full.weights_hashed and any(line.startswith("SHA-256 of every weight payload") for line in full.checked())
