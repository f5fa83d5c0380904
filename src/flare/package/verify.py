"""Payload integrity: what every load checks of the stored bytes, and the full hash on request.

Every load: each payload's size against the signed manifest; frontend and module-global payloads read
into memory and hashed (the bytes that were hashed are the bytes used); each weight payload's
safetensors header parsed and compared with the tensor list the manifest records, and its sampled
SHA-256 (`SAMPLE_BLOCKS` blocks of `SAMPLE_BLOCK_BYTES` spread over the payload, recorded at export)
compared. That catches truncation, a damaged header, a payload swapped for another and damage that
lands in a sampled block; it does not prove the rest of the weight bytes, and the report says so
(`StoredDataCheck`). `--verify-weights` hashes every weight payload whole, with up to eight workers.
"""

from __future__ import annotations

import hashlib
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterable

from flare.errors import PreparationError
from flare.package import safetensors_io as st
from flare.package.format import PackageFiles
from flare.package.manifest import PayloadRecord, PayloadSample, TensorRecord
from flare.package.store import copy_range, sha256_file

MAX_HASH_WORKERS = 8
# 64 blocks of 64 KiB: 4 MiB read per weight payload at most (docs/performance.md has the cost).
SAMPLE_BLOCK_BYTES = 64 * 1024
SAMPLE_BLOCKS = 64


class IntegrityError(PreparationError):
    """A payload differs from what the signed manifest records."""


def _advice() -> str:
    return "the package was modified or damaged after signing; nothing was served — export or download it again"


def check_layout(files: PackageFiles, payloads: Iterable[PayloadRecord]) -> None:
    """Every payload the manifest names exists with exactly its recorded size (reads no contents)."""
    for record in payloads:
        location = files.locate(record)
        try:
            actual = location.path.stat().st_size - location.offset if files.form != "packed" \
                else location.size
        except FileNotFoundError:
            raise IntegrityError(f"payload {record.name} is missing ({location.path}); {_advice()}") from None
        if files.form == "packed" and location.offset + location.size > files.primary_path.stat().st_size:
            raise IntegrityError(f"payload {record.name} is truncated in {files.primary_path}; {_advice()}")
        if actual != record.size:
            raise IntegrityError(f"payload {record.name} is {'truncated' if actual < record.size else 'resized'}"
                                 f": {actual} bytes, the signed manifest records {record.size}; {_advice()}")


def read_verified(files: PackageFiles, record: PayloadRecord) -> bytes:
    """A small payload's bytes, checked against its signed hash."""
    location = files.locate(record)
    with open(location.path, "rb") as handle:
        handle.seek(location.offset)
        data = handle.read(record.size)
    _compare(record, len(data), hashlib.sha256(data).hexdigest())
    return data


def verify_payloads(files: PackageFiles, payloads: Iterable[PayloadRecord],
                    on_bytes: Callable[[int], None] | None = None, workers: int = MAX_HASH_WORKERS) -> None:
    """Hash each distinct payload (up to `workers` at once); raise naming the first that differs."""
    distinct = {record.sha256: record for record in payloads}.values()
    lock = threading.Lock()

    def report(count: int) -> None:
        if on_bytes is not None:
            with lock:
                on_bytes(count)

    def check(record: PayloadRecord) -> None:
        location = files.locate(record)
        digest = sha256_file(location.path, location.offset, record.size, report)
        _compare(record, _size(files, location, record), digest)

    with ThreadPoolExecutor(max_workers=max(1, min(workers, len(distinct)))) as pool:
        for future in [pool.submit(check, record) for record in distinct]:
            future.result()


def _size(files: PackageFiles, location, record: PayloadRecord) -> int:
    if files.form == "packed":
        return location.size
    return location.path.stat().st_size


def _compare(record: PayloadRecord, size: int, digest: str) -> None:
    if size != record.size:
        raise IntegrityError(f"payload {record.name} is truncated: {size} bytes, the signed manifest records "
                             f"{record.size}; {_advice()}")
    if digest != record.sha256:
        raise IntegrityError(f"payload {record.name} is corrupt: its SHA-256 is {digest}, the signed manifest "
                             f"records {record.sha256}; {_advice()}")


def copy_payload(files: PackageFiles, record: PayloadRecord, target, consequence: str) -> None:
    """Copy one payload's bytes, wherever `files` keeps them, into the file `target`, checking them against
    the signed size and SHA-256 on the way; the IntegrityError ends with `consequence`."""
    location = files.locate(record)
    digest = hashlib.sha256()
    with open(target, "wb") as sink:
        copied = copy_range(location.path, location.offset, record.size, sink, digest.update)
    if copied != record.size or digest.hexdigest() != record.sha256:
        raise IntegrityError(f"payload {record.name} differs from the signed manifest; {consequence}")


# --- weight payloads: headers and sampled hashes ---------------------------------------------------

def sampled_ranges(size: int, block_bytes: int, blocks: int) -> list[tuple[int, int]]:
    """The [start, end) byte ranges a sample covers: `blocks` blocks spread evenly from the first byte
    to the last (never overlapping), or the whole payload when it is no larger than they are."""
    if size <= block_bytes * blocks:
        return [(0, size)]
    if blocks == 1:
        return [(0, block_bytes)]
    last = size - block_bytes
    return [(last * i // (blocks - 1), last * i // (blocks - 1) + block_bytes) for i in range(blocks)]


def sampled_sha256(path: Path, offset: int, size: int, block_bytes: int, blocks: int, what: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for start, end in sampled_ranges(size, block_bytes, blocks):
            handle.seek(offset + start)
            data = handle.read(end - start)
            if len(data) != end - start:
                raise IntegrityError(f"{what} is truncated: it ends before byte {start + len(data)} of the "
                                     f"signed {size}; {_advice()}")
            digest.update(data)
    return digest.hexdigest()


def describe_weight_payload(path: Path, size: int) -> tuple[tuple[TensorRecord, ...], PayloadSample]:
    """What export records of a weight payload it wrote: its header's tensor list and its sampled hash."""
    with open(path, "rb") as handle:
        header = st.read_header(handle, 0, size, what=str(path))
    digest = sampled_sha256(path, 0, size, SAMPLE_BLOCK_BYTES, SAMPLE_BLOCKS, str(path))
    return tensor_records(header), PayloadSample(SAMPLE_BLOCK_BYTES, SAMPLE_BLOCKS, digest)


def tensor_records(header: st.Header) -> tuple[TensorRecord, ...]:
    return tuple(TensorRecord(entry.name, entry.dtype, entry.shape,
                              (entry.start - header.data_start, entry.end - header.data_start))
                 for entry in header.tensors)


def check_weight_payload(files: PackageFiles, record: PayloadRecord) -> int:
    """Parse the payload's header and compare it (and its sampled hash) with the signed record; return
    the bytes the sample read (0 when the manifest records no sample)."""
    location = files.locate(record)
    what = f"payload {record.name}"
    with open(location.path, "rb") as handle:
        header = st.read_header(handle, location.offset, record.size, what=what)
    if header.total_size != record.size:
        raise IntegrityError(f"{what} is corrupt: its header describes {header.total_size} bytes, the signed "
                             f"manifest records {record.size}; {_advice()}")
    if record.tensors is not None and tensor_records(header) != record.tensors:
        raise IntegrityError(f"{what} is corrupt: its header's tensors ({_first_difference(header, record)}) "
                             f"differ from the signed manifest's; {_advice()}")
    sample = record.sample
    if sample is None:
        return 0
    digest = sampled_sha256(location.path, location.offset, record.size, sample.block_bytes, sample.blocks, what)
    if digest != sample.sha256:
        raise IntegrityError(f"{what} is corrupt: the SHA-256 of its sampled blocks is {digest}, the signed "
                             f"manifest records {sample.sha256}; {_advice()}")
    return sum(end - start for start, end in sampled_ranges(record.size, sample.block_bytes, sample.blocks))


def _first_difference(header: st.Header, record: PayloadRecord) -> str:
    found, signed = tensor_records(header), record.tensors or ()
    for ours, theirs in zip(found, signed):
        if ours != theirs:
            return f"{ours.name} {ours.dtype} {list(ours.shape)} where the manifest has " \
                   f"{theirs.name} {theirs.dtype} {list(theirs.shape)}"
    return f"{len(found)} tensors where the manifest has {len(signed)}"


@dataclass(frozen=True)
class StoredDataCheck:
    """What a load checked of the stored bytes, so reports say exactly that and call nothing else verified."""

    payloads: int                      # every payload's size against the manifest
    hashed_small: int                  # frontend and module-global payloads hashed whole
    weight_payloads: int
    headers_recorded: int              # weight headers that matched a signed tensor list (others: parsed only)
    sampled: int                       # weight payloads whose sampled hash matched
    sampled_bytes: int
    weight_bytes: int
    weights_hashed: bool               # --verify-weights: every weight payload hashed whole

    def checked(self) -> list[str]:
        from flare.ui.progress import format_bytes
        lines = [f"sizes of all {self.payloads} payloads",
                 f"SHA-256 of the frontend and graph payloads ({self.hashed_small})",
                 f"safetensors headers of {self.weight_payloads} weight payloads"
                 + (" against the signed tensor lists" if self.headers_recorded == self.weight_payloads else
                    f" ({self.headers_recorded} against a signed tensor list)")]
        if self.sampled:
            lines.append(f"sampled SHA-256 of {self.sampled} weight payloads ({format_bytes(self.sampled_bytes)} "
                         f"of {format_bytes(self.weight_bytes)})")
        if self.weights_hashed:
            lines.append(f"SHA-256 of every weight payload ({format_bytes(self.weight_bytes)})")
        return lines

    def not_checked(self) -> list[str]:
        lines = []
        if not self.weights_hashed and self.sampled_bytes < self.weight_bytes:
            lines.append("the weight bytes outside the sampled blocks: `flare run --verify-weights` hashes "
                         "every weight payload")
        if self.sampled < self.weight_payloads:
            lines.append(f"a sampled hash of {self.weight_payloads - self.sampled} weight payloads: "
                         "none recorded (exported before sampled hashes)")
        return lines

