"""The disk tier's files (runner side): one file per page under the package's own folder.

    [paths] prefix_cache/<identity>.<layout>/<chained page hash, hex>.kv
    [paths] prefix_cache/<identity>.<layout>/identity.json       what the folder holds, for people and inspect

`identity` is the served package's (the SHA-256 of its signed manifest), `layout` a digest of the KV
format (every cache tensor's dtype and page shape: page size, layers, heads), so another model, version
or cache format never opens them. A file is a 4,096-byte header (magic, then a msgpack record naming
identity, layout, key, payload size and the payload's XXH3-128) followed by one page of every cache
tensor, padded to 4,096 bytes. A file is written under a temporary name and renamed, so a stop mid-write
leaves no half file under a real name. A read checks everything before the page may be served: a damaged
file (bad magic, header, size or checksum) is deleted, a foreign one (another identity or layout) left
alone; either is reported and never served.

`staged` reads and writes through the OS page cache; `direct` opens with O_DIRECT (the page cache is
bypassed, so retained states do not push the package's weights out of it), through an aligned buffer.
"""

from __future__ import annotations

import errno
import json
import mmap
import os
import threading
import time
from pathlib import Path

import msgspec
import xxhash

MAGIC = b"FLAREKV\x01"
HEADER_BYTES = 4096
ALIGN = 4096
SUFFIX = ".kv"
STALE_TEMPORARY_S = 3600        # a temporary file this old was left by a stop mid-write


class PageFileHeader(msgspec.Struct, frozen=True):
    identity: str
    layout: str
    key: bytes
    payload_bytes: int
    checksum: bytes                     # XXH3-128 of the payload


class RetainedFileError(Exception):
    """A file that must not be served; `kind` is "missing", "damaged" or "foreign"."""

    def __init__(self, kind: str, text: str) -> None:
        super().__init__(text)
        self.kind = kind


def layout_digest(layout: str) -> str:
    return xxhash.xxh3_128_hexdigest(layout.encode())[:12]


def folder_name(identity: str, layout: str) -> str:
    return f"{identity[:24]}.{layout_digest(layout)}"


def file_bytes(payload_bytes: int) -> int:
    """The size of every page file of this payload size."""
    return HEADER_BYTES + -(-payload_bytes // ALIGN) * ALIGN


class DiskStore:
    def __init__(self, root: Path, identity: str, layout: str, payload_bytes: int, transport: str = "staged",
                 describe: dict | None = None) -> None:
        self.directory = Path(root) / folder_name(identity, layout)
        self.identity, self.layout, self.transport = identity, layout, transport
        self.payload_bytes = payload_bytes
        self.file_bytes = file_bytes(payload_bytes)
        self._local = threading.local()
        self.directory.mkdir(parents=True, exist_ok=True, mode=0o700)
        record = self.directory / "identity.json"
        if not record.exists():
            text = json.dumps({"identity": identity, "layout": layout, "page_file_bytes": self.file_bytes,
                               **(describe or {})}, indent=2)
            temporary = self.directory / f".identity.{os.getpid()}.tmp"
            temporary.write_text(text + "\n")
            os.replace(temporary, record)

    def listing(self) -> tuple[tuple[bytes, ...], list[str]]:
        """The keys of the folder's page files, least recently used first, and notes on files skipped."""
        found, notes = [], []
        now = time.time()
        with os.scandir(self.directory) as entries:
            for entry in entries:
                name = entry.name
                if name.endswith(".tmp"):
                    if now - entry.stat().st_mtime > STALE_TEMPORARY_S:
                        _unlink(entry.path)
                    continue
                if not name.endswith(SUFFIX):
                    continue
                key = _key_of(name)
                stat = entry.stat()
                if key is None or stat.st_size != self.file_bytes:
                    notes.append(f"{entry.path} is not a page file of this package's KV format "
                                 f"({stat.st_size:,} bytes, expected {self.file_bytes:,}); skipped")
                    continue
                found.append((stat.st_mtime_ns, key))
        found.sort()
        return tuple(key for _, key in found), notes

    def path(self, key: bytes) -> Path:
        return self.directory / f"{key.hex()}{SUFFIX}"

    def write(self, key: bytes, parts: list[memoryview]) -> None:
        """The page `parts` (one block per cache tensor) as the file of `key`; OSError when it cannot be."""
        header = self._header(key, parts)
        temporary = self.directory / f".{key.hex()}.{os.getpid()}.{threading.get_ident()}.tmp"
        try:
            if self.transport == "direct":
                buffer = self._aligned()
                buffer[:HEADER_BYTES] = header
                offset = HEADER_BYTES
                for part in parts:
                    buffer[offset:offset + len(part)] = part
                    offset += len(part)
                self._write_all(temporary, [buffer], os.O_DIRECT)
            else:
                padding = bytes(self.file_bytes - HEADER_BYTES - self.payload_bytes)
                self._write_all(temporary, [header, *parts, padding], 0)
            os.replace(temporary, self.path(key))
        except BaseException:
            _unlink(temporary)
            raise

    def read(self, key: bytes, parts: list[memoryview]) -> None:
        """Fill `parts` from the file of `key`; RetainedFileError when it must not be served (a damaged
        file is deleted first)."""
        path = self.path(key)
        try:
            fd = os.open(path, os.O_RDONLY | (os.O_DIRECT if self.transport == "direct" else 0))
        except FileNotFoundError:
            raise RetainedFileError("missing", f"{path} is gone") from None
        try:
            if self.transport == "direct":
                buffer = self._aligned()
                count = os.preadv(fd, [buffer], 0)
                header = bytes(buffer[:HEADER_BYTES])
                offset = HEADER_BYTES
                for part in parts:
                    part[:] = buffer[offset:offset + len(part)]
                    offset += len(part)
            else:
                header_buffer = bytearray(HEADER_BYTES)
                count = os.preadv(fd, [header_buffer, *parts], 0)
                header = bytes(header_buffer)
        finally:
            os.close(fd)
        try:
            self._check(key, header, parts, count)
        except RetainedFileError as error:
            if error.kind == "damaged":
                _unlink(path)
            raise
        os.utime(path)                                  # recently used: a restart lists it late

    def delete(self, key: bytes) -> None:
        _unlink(self.path(key))

    # ---- internals -------------------------------------------------------------------------------

    def _header(self, key: bytes, parts: list[memoryview]) -> bytes:
        if sum(len(part) for part in parts) != self.payload_bytes:
            raise ValueError(f"a page of {sum(len(p) for p in parts)} bytes; files here hold {self.payload_bytes}")
        digest = xxhash.xxh3_128()
        for part in parts:
            digest.update(part)
        record = msgspec.msgpack.encode(PageFileHeader(self.identity, self.layout, key, self.payload_bytes,
                                                       digest.digest()))
        header = MAGIC + len(record).to_bytes(4, "little") + record
        if len(header) > HEADER_BYTES:
            raise ValueError("the page file header does not fit its block")
        return header + bytes(HEADER_BYTES - len(header))

    def _check(self, key: bytes, header: bytes, parts: list[memoryview], count: int) -> None:
        path = self.path(key)
        if count < HEADER_BYTES + self.payload_bytes or header[:len(MAGIC)] != MAGIC:
            raise RetainedFileError("damaged", f"{path} is damaged (short, or not a page file); deleted")
        length = int.from_bytes(header[len(MAGIC):len(MAGIC) + 4], "little")
        try:
            record = msgspec.msgpack.decode(header[len(MAGIC) + 4:len(MAGIC) + 4 + length], type=PageFileHeader)
        except (msgspec.DecodeError, msgspec.ValidationError):
            raise RetainedFileError("damaged", f"{path} has a damaged header; deleted") from None
        if record.identity != self.identity or record.layout != self.layout:
            raise RetainedFileError("foreign", f"{path} was written for another package or KV format "
                                               f"({record.identity[:16]}…, {record.layout}); skipped")
        if record.key != key or record.payload_bytes != self.payload_bytes:
            raise RetainedFileError("damaged", f"{path} holds another page than its name says; deleted")
        digest = xxhash.xxh3_128()
        for part in parts:
            digest.update(part)
        if digest.digest() != record.checksum:
            raise RetainedFileError("damaged", f"{path} fails its checksum; deleted")

    def _aligned(self) -> mmap.mmap:
        """This thread's page-aligned buffer of one file (O_DIRECT needs aligned memory and sizes)."""
        buffer = getattr(self._local, "buffer", None)
        if buffer is None:
            buffer = self._local.buffer = mmap.mmap(-1, self.file_bytes)
        return buffer

    def _write_all(self, path: Path, buffers: list, flags: int) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | flags, 0o600)
        try:
            written = os.pwritev(fd, buffers, 0)
            if written != self.file_bytes:
                raise OSError(errno.EIO, f"wrote {written:,} of {self.file_bytes:,} bytes")
        finally:
            os.close(fd)


def retained_on_disk(root: Path, identity: str) -> list[dict]:
    """The package's folders under `root` (one per KV layout it was served with): path, page files, bytes."""
    found = []
    if not Path(root).is_dir():
        return found
    for folder in sorted(Path(root).glob(f"{identity[:24]}.*")):
        files = [entry.stat().st_size for entry in os.scandir(folder) if entry.name.endswith(SUFFIX)]
        found.append({"path": str(folder), "pages": len(files), "bytes": sum(files)})
    return found


def check_direct_io(directory: Path) -> str | None:
    """Why files under `directory` cannot be opened with O_DIRECT (None: they can)."""
    if not hasattr(os, "O_DIRECT"):
        return "this system has no O_DIRECT"
    directory.mkdir(parents=True, exist_ok=True)
    probe = directory / f".direct-probe.{os.getpid()}.tmp"
    try:
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_DIRECT, 0o600)
        os.close(fd)
    except OSError as error:
        return f"the file system refuses O_DIRECT ({error.strerror})"
    finally:
        _unlink(probe)
    return None


def _key_of(name: str) -> bytes | None:
    stem = name[:-len(SUFFIX)]
    if len(stem) != 64:
        return None
    try:
        return bytes.fromhex(stem)
    except ValueError:
        return None


def _unlink(path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
