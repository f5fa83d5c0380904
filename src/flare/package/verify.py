"""Payload integrity: sizes against the signed manifest always, SHA-256 hashes where required.

Frontend and module-global payloads are read into memory and hashed on every load (the bytes that
were hashed are the bytes used). `--verify-weights` hashes every payload with up to eight workers.
"""

from __future__ import annotations

import hashlib
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable

from flare.errors import PreparationError
from flare.package.format import PackageFiles
from flare.package.manifest import PayloadRecord
from flare.package.store import copy_range, sha256_file

MAX_HASH_WORKERS = 8


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
