"""Payload bytes from rank zero to a peer's cache over several streams, checked against the signed manifest.

    serve_stream(channel, files, allowed)                     rank zero: answer one stream's Fetches
    plan_receipt(cache, records) -> Receipt                   a peer: what it has, what it must fetch
    check_space(cache, receipt, rank)                         before a byte is copied
    receive(address, session, receipt, streams, tree, cache)  fetch, hash, store as blobs, link into tree

A peer fetches only the payloads whose blobs its cache lacks, each whole on one stream (largest
first, so the streams finish together), hashing as the bytes arrive; a payload whose size or SHA-256
differs from the signed record is refused before it becomes a blob. Payloads the cache holds are
linked without a byte sent.
"""

from __future__ import annotations

import hashlib
import os
import queue
import shutil
import threading
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

from flare.errors import CapacityError
from flare.hosts.address import Address, connect
from flare.hosts.frames import Channel
from flare.hosts.handshake import client_handshake
from flare.hosts.messages import CHUNK_BYTES, PROTOCOL_NAME, RANKS, Chunk, Fetch, Sent
from flare.package.format import PackageFiles
from flare.package.manifest import PayloadRecord
from flare.package.store import ModelCache
from flare.package.verify import IntegrityError

STREAM_TIMEOUT_S = 60.0
GIB = 1 << 30


def serve_stream(channel: Channel, files: PackageFiles, allowed: dict[str, PayloadRecord]) -> None:
    """Send each payload a peer's stream asks for (only those offered to its rank) until it hangs up."""
    while True:
        request = channel.receive(timeout=None)
        if not isinstance(request, Fetch) or request.name not in allowed:
            channel.close()
            return
        send_payload(channel, files, allowed[request.name])


def send_payload(channel: Channel, files: PackageFiles, record: PayloadRecord) -> None:
    """One payload's bytes as Chunks, then Sent(name)."""
    location = files.locate(record)
    with open(location.path, "rb") as source:
        source.seek(location.offset)
        remaining = record.size
        while remaining:
            data = source.read(min(CHUNK_BYTES, remaining))
            if not data:
                break
            channel.send(Chunk(data))
            remaining -= len(data)
    channel.send(Sent(record.name))


@dataclass(frozen=True)
class Receipt:
    """A peer's plan: every payload it needs, which of them its cache already holds, what it fetches."""

    records: tuple[PayloadRecord, ...]
    held: tuple[PayloadRecord, ...]          # blobs already in the cache: linked, not sent
    fetched: tuple[PayloadRecord, ...]       # one record per distinct missing blob, largest first

    @property
    def fetch_bytes(self) -> int:
        return sum(record.size for record in self.fetched)

    @property
    def held_bytes(self) -> int:
        return sum(record.size for record in self.held)


def plan_receipt(cache: ModelCache, records: tuple[PayloadRecord, ...]) -> Receipt:
    held, missing = [], {}
    for record in records:
        if cache.has_blob(record.sha256):
            held.append(record)
        else:
            missing.setdefault(record.sha256, record)
    fetched = sorted(missing.values(), key=lambda record: record.size, reverse=True)
    return Receipt(records, tuple(held), tuple(fetched))


def free_bytes(path: Path) -> int:
    """Free space for an unprivileged writer on the filesystem holding `path` (or its nearest parent)."""
    path = Path(path)
    while not path.exists():
        path = path.parent
    return shutil.disk_usage(path).free


def check_space(cache: ModelCache, receipt: Receipt, rank: int) -> None:
    """Refuse, before copying, a launch whose payloads do not fit under the rank's cache."""
    free = free_bytes(cache.root)
    if receipt.fetch_bytes > free:
        raise CapacityError(
            f"{free / GIB:.1f} GiB free under {cache.root}; this launch stores {receipt.fetch_bytes / GIB:.1f} "
            f"GiB there (rank {rank}'s payloads that the cache lacks). Free space there, or give rank {rank} a "
            "cache on a larger disk with --model-cache PATH")


def receive(address: Address, session: bytes, rank: int, receipt: Receipt, streams: int, tree: Path,
            cache: ModelCache, source: str) -> None:
    """Fetch `receipt.fetched` over up to `streams` connections into blobs, then lay every record of the
    receipt out under `tree` as a link to its blob. Raises the first failure; the others stop."""
    work: queue.Queue[PayloadRecord] = queue.Queue()
    for record in receipt.fetched:
        work.put(record)
    stop = threading.Event()
    count = max(0, min(streams, len(receipt.fetched)))
    run_together([lambda index=index: _stream(address, session, rank, work, stop, tree / ".incoming", cache, source,
                                              index) for index in range(count)], stop)
    for record in receipt.records:
        cache.link_blob(record.sha256, tree / record.name)
    shutil.rmtree(tree / ".incoming", ignore_errors=True)      # links to the new blobs until the tree has its own


def run_together(tasks: list[Callable[[], Any]], stop: threading.Event | None = None) -> None:
    """Run each task on a thread of its own and wait for all; the first failure is raised here (and sets
    `stop`, which the others may watch to end early)."""
    failures: list[BaseException] = []

    def run(task: Callable[[], Any]) -> None:
        try:
            task()
        except BaseException as error:        # noqa: BLE001 - handed to the caller's thread
            failures.append(error)
            if stop is not None:
                stop.set()

    threads = [threading.Thread(target=run, args=(task,), name="flare-transfer", daemon=True) for task in tasks]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    if failures:
        raise failures[0]


def _stream(address: Address, session: bytes, rank: int, work: queue.Queue, stop: threading.Event,
            incoming: Path, cache: ModelCache, source: str, index: int) -> None:
    channel = Channel(connect(address, STREAM_TIMEOUT_S), f"{source}, stream {index + 1}", RANKS)
    try:
        client_handshake(channel, PROTOCOL_NAME, "stream", rank=rank, session=session)
        while not stop.is_set():
            try:
                record = work.get_nowait()
            except queue.Empty:
                return
            _fetch(channel, record, incoming, cache, source)
    finally:
        channel.close()


def _fetch(channel: Channel, record: PayloadRecord, incoming: Path, cache: ModelCache, source: str) -> None:
    channel.send(Fetch(record.name))
    receive_payload(lambda: channel.receive(timeout=STREAM_TIMEOUT_S), record, incoming, cache, source)


def receive_payload(next_message: Callable[[], Any], record: PayloadRecord, incoming: Path, cache: ModelCache,
                    source: str) -> None:
    """One payload's Chunks (until Sent) into a new blob, hashed as they arrive; refused unless they are the
    signed record's bytes. The staged file stays in `incoming` (a link keeping the blob) until the caller's
    tree links it."""
    incoming.mkdir(parents=True, exist_ok=True)
    staged = incoming / record.sha256
    digest, size = hashlib.sha256(), 0
    with open(staged, "wb") as sink:
        while True:
            message = next_message()
            if isinstance(message, Sent):
                break
            if not isinstance(message, Chunk) or size + len(message.data) > record.size:
                os.unlink(staged)
                raise IntegrityError(f"payload {record.name} from {source} is longer than the {record.size} bytes "
                                     "the signed manifest records; nothing of it was stored")
            digest.update(message.data)
            sink.write(message.data)
            size += len(message.data)
    if size != record.size or digest.hexdigest() != record.sha256:
        os.unlink(staged)
        raise IntegrityError(
            f"payload {record.name} from {source} differs from the signed manifest ({size} bytes with SHA-256 "
            f"{digest.hexdigest()}; the manifest records {record.size} bytes with {record.sha256}): it was altered "
            "in transit or on the sender's disk, and nothing of it was stored. Check the network and the sender's "
            "copy of the package (`flare run --verify-weights` there hashes every payload), then try again")
    cache.store_payload(staged, record.sha256)
