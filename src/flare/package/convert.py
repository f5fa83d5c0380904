"""`ignition convert`: a cache entry (or packed file) to a standalone packed file or directory.

The signed manifest text, its signature and every payload's bytes are carried over exactly; only
the physical form changes. A directory on the source's filesystem shares inodes with it; elsewhere
bytes are copied. No signing key and no GPU are needed.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Sequence

from flare.errors import UsageError
from flare.package import format as fmt
from flare.package.manifest import PayloadRecord
from flare.package.store import copy_range, sha256_file, try_hard_link
from flare.package.trust import TrustOptions, verify_signature
from flare.package.verify import IntegrityError, check_layout, copy_payload

FORMS = fmt.FORMS


def convert(source: Path, output: Path, form: str = "directory", trust: TrustOptions | None = None) -> Path:
    """Write `source` in `form` at `output`; the signature is verified first and every payload's hash as copied."""
    if form not in FORMS:
        raise UsageError(f"--form {form}: choose directory or packed")
    output = Path(output)
    if output.exists() or output.is_symlink():
        raise UsageError(f"{output} already exists; choose a new --output path")
    if not output.parent.is_dir():
        raise UsageError(f"the parent directory of {output} does not exist")
    files = fmt.read_package_files(Path(source))
    manifest = files.primary.manifest
    verify_signature(files.primary.manifest_body, files.primary.signature, manifest, files.primary.profile_json,
                     trust or TrustOptions(require_acceptance=False), str(files.primary_path))
    check_layout(files, manifest.payloads)
    temporary = output.with_name(f".{output.name}.partial")
    if temporary.exists():
        shutil.rmtree(temporary) if temporary.is_dir() else temporary.unlink()
    try:
        if form == "directory":
            _write_directory(files, manifest.payloads, temporary)
        else:
            _write_packed(files, manifest.payloads, temporary)
        os.rename(temporary, output)
    except BaseException:
        if temporary.is_dir():
            shutil.rmtree(temporary, ignore_errors=True)
        else:
            temporary.unlink(missing_ok=True)
        raise
    return output


def _write_directory(files: fmt.PackageFiles, payloads: Sequence[PayloadRecord], destination: Path) -> None:
    destination.mkdir()
    fmt.write_primary(destination / fmt.PRIMARY_NAME, files.primary)
    for record in payloads:
        target = destination / record.name
        target.parent.mkdir(parents=True, exist_ok=True)
        location = files.locate(record)
        if files.form == "directory" and try_hard_link(location.path, target):
            continue
        copy_payload(files, record, target, "conversion stopped")


def _write_packed(files: fmt.PackageFiles, payloads: Sequence[PayloadRecord], destination: Path) -> None:
    """One safetensors file: the primary's metadata, then each payload as a 64-byte aligned U8 tensor."""
    entries, chunks = _packed_layout(payloads)
    header = _packed_header(files.primary.metadata("packed"), entries)
    with open(destination, "wb") as sink:
        sink.write(header)
        for kind, value in chunks:
            if kind == "pad":
                sink.write(b"\0" * value)
                continue
            record = value
            location = files.locate(record)
            start = sink.tell()
            copy_range(location.path, location.offset, record.size, sink)
            if sink.tell() - start != record.size:
                raise IntegrityError(f"payload {record.name} is truncated; conversion stopped")
    written = fmt.read_package_files(destination).packed_locations
    for record in payloads:                              # hash what was written, not what was read
        digest = sha256_file(destination, written[record.name].offset, record.size)
        if digest != record.sha256:
            raise IntegrityError(f"payload {record.name} differs from the signed manifest; conversion stopped")


def _packed_layout(payloads: Sequence[PayloadRecord]):
    """Tensor entries (name, start, end) and the write plan, with padding so payloads start aligned."""
    entries, chunks, offset = [], [], 0
    for index, record in enumerate(payloads):
        entries.append((fmt.PACKED_PREFIX + record.name, offset, offset + record.size))
        chunks.append(("payload", record))
        offset += record.size
        pad = -offset % fmt.PACKED_ALIGNMENT
        if pad:
            entries.append((f"{fmt.PADDING_PREFIX}{index}", offset, offset + pad))
            chunks.append(("pad", pad))
            offset += pad
    return entries, chunks


def _packed_header(metadata: dict[str, str], entries) -> bytes:
    import json
    import struct
    fields: dict[str, object] = {"__metadata__": metadata}
    for name, start, end in entries:
        fields[name] = {"dtype": "U8", "shape": [end - start], "data_offsets": [start, end]}
    text = json.dumps(fields, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-(8 + len(text)) % fmt.PACKED_ALIGNMENT)       # data section starts aligned
    return struct.pack("<Q", len(text)) + text
