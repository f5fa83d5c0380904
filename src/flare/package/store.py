"""The shared model cache: content-addressed blobs, published entries, default refs, staging and locks.

    <root>/blobs/<sha256>.safetensors          immutable payload objects (read-only files)
    <root>/models/<model-key>/<version>/       published entries; payload files are hard links to blobs
    <root>/refs/<model-key>                    the selected default version, one line (see below)
    <root>/staging/<id>/                       an export being built; abandoned ones are reclaimed by gc
    <root>/locks/                              stable lock files (never deleted)

Publication is one atomic step, the rename of a finished, synced staging tree into models/: before it
there is nothing new in models/ and the default is unchanged; after it the entry is complete and, when
it is to be selected, already the default. For that, the ref is written just before the rename in its
pending form, two lines (the new version, then the previous default or an empty line), which reads as
the new version once that entry exists and as the previous default until then; after the rename it is
tidied to one line. A publication killed at any point therefore leaves either the complete selected
entry or no entry (and only an abandoned staging tree, which gc reclaims). A pending ref found under the
model's lock is stale (its writer died before the rename) and is settled to what it reads as.
A blob whose link count is 1 is referenced by no entry and no staging tree, so gc may remove it.

Leases: a process serving or inspecting an entry holds a shared `flock` on the entry's lease file;
`remove` takes it exclusively without waiting, so it fails while anyone holds a lease. An export holds
its staging tree's lock the same way, so gc never reclaims a live export.
"""

from __future__ import annotations

import contextlib
import datetime
import errno
import fcntl
import hashlib
import os
import re
import shutil
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Callable, Iterator

from filelock import FileLock

from flare.errors import UsageError

DEFAULT_CACHE_ROOT = Path("~/.cache/flare/packages")
HASH_CHUNK = 8 * 1024 * 1024
_MODEL_KEY = re.compile(r"[^a-z0-9._-]+")


def model_key_for(model_id: str) -> str:
    """A filesystem-safe key for a canonical model id: `Org/Name` becomes `org--name`."""
    key = _MODEL_KEY.sub("-", model_id.lower().replace("/", "--")).strip("-.")
    if not key:
        raise UsageError(f"model id {model_id!r} gives an empty cache key")
    return key


def sha256_file(path: Path, offset: int = 0, size: int | None = None, on_bytes=None) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        handle.seek(offset)
        remaining = size
        while remaining is None or remaining > 0:
            chunk = handle.read(HASH_CHUNK if remaining is None else min(HASH_CHUNK, remaining))
            if not chunk:
                break
            digest.update(chunk)
            if remaining is not None:
                remaining -= len(chunk)
            if on_bytes is not None:
                on_bytes(len(chunk))
    return digest.hexdigest()


def try_hard_link(source: Path, target: Path) -> bool:
    """Hard-link `target` to `source`; False where the filesystem cannot (another device, no links), so
    the caller copies the bytes instead. Other errors propagate."""
    try:
        os.link(source, target)
        return True
    except OSError as error:
        if error.errno in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
            return False
        raise


def copy_range(path: Path, offset: int, size: int, sink: BinaryIO, on_chunk=None) -> int:
    """Append `size` bytes from `offset` of `path` to the open file `sink`, passing each chunk to
    `on_chunk` (to hash it on the way); returns the bytes copied, fewer when the file ends early."""
    remaining = size
    with open(path, "rb") as source:
        source.seek(offset)
        while remaining:
            chunk = source.read(min(remaining, HASH_CHUNK))
            if not chunk:
                break
            if on_chunk is not None:
                on_chunk(chunk)
            sink.write(chunk)
            remaining -= len(chunk)
    return size - remaining


@dataclass(frozen=True)
class EntryId:
    model_key: str
    version: str

    def __str__(self) -> str:
        return f"{self.model_key}@{self.version}"


class ModelCache:
    """One cache root. Every method is safe to call from several processes at once."""

    def __init__(self, root: Path):
        self.root = Path(root).expanduser()

    # --- layout -------------------------------------------------------------------------------
    @property
    def blobs(self) -> Path:
        return self.root / "blobs"

    @property
    def models(self) -> Path:
        return self.root / "models"

    @property
    def refs(self) -> Path:
        return self.root / "refs"

    @property
    def staging(self) -> Path:
        return self.root / "staging"

    @property
    def locks(self) -> Path:
        return self.root / "locks"

    def ensure(self) -> None:
        for directory in (self.blobs, self.models, self.refs, self.staging, self.locks):
            directory.mkdir(parents=True, exist_ok=True)

    def entry_path(self, entry: EntryId) -> Path:
        return self.models / entry.model_key / entry.version

    def blob_path(self, sha256: str) -> Path:
        return self.blobs / f"{sha256}.safetensors"

    def lock(self, name: str) -> FileLock:
        self.locks.mkdir(parents=True, exist_ok=True)
        return FileLock(str(self.locks / f"{name}.lock"))

    # --- staging and publication --------------------------------------------------------------
    @contextlib.contextmanager
    def staging_tree(self) -> Iterator[Path]:
        """A fresh staging directory, locked for as long as the export runs."""
        self.ensure()
        name = uuid.uuid4().hex
        lock_path = self.locks / f"staging-{name}.lock"
        with _flock(lock_path, exclusive=True, wait=True):
            path = self.staging / name
            path.mkdir()
            yield path                                  # an exception leaves the tree for gc
            shutil.rmtree(path, ignore_errors=True)     # what is left after publication
            lock_path.unlink()

    def store_payload(self, staged_file: Path, sha256: str) -> bool:
        """Make a staged payload file a hard link to its blob; return True when the blob already existed."""
        blob = self.blob_path(sha256)
        with self.lock("blobs"):
            if blob.exists():
                temporary = staged_file.with_name(staged_file.name + ".link")
                os.link(blob, temporary)
                os.replace(temporary, staged_file)
                return True
            os.chmod(staged_file, 0o444)
            os.link(staged_file, blob)
            return False

    def link_blob(self, sha256: str, destination: Path) -> None:
        """Link an existing blob into an entry tree being built (for exports reusing cached payloads)."""
        destination.parent.mkdir(parents=True, exist_ok=True)
        with self.lock("blobs"):
            os.link(self.blob_path(sha256), destination)

    def has_blob(self, sha256: str) -> bool:
        return self.blob_path(sha256).exists()

    def publish(self, staged_entry: Path, entry: EntryId, select: bool = True) -> Path:
        """Publish a finished staging tree as `entry` (a version signed elsewhere), selected if asked."""
        with self.lock(f"model-{entry.model_key}"):
            if self.entry_path(entry).exists():
                raise UsageError(f"{entry} is already in {self.root}")
            return self._commit(staged_entry, entry, select)

    def publish_new_version(self, staged_entry: Path, model_key: str, finish: Callable[[str], None],
                            select: bool = True) -> Path:
        """Choose a fresh version under the model's lock, let `finish(version)` write the signed primary,
        then publish the tree as that version, selected as the model's default if asked."""
        with self.lock(f"model-{model_key}"):
            entry = EntryId(model_key, self._fresh_version(model_key))
            self._publication_step("publishing")
            finish(entry.version)
            self._publication_step("signed")
            return self._commit(staged_entry, entry, select)

    def _commit(self, staged_entry: Path, entry: EntryId, select: bool) -> Path:
        """The atomic step (see the module's docstring), under the model's lock."""
        self._settle_ref(entry.model_key)
        _sync_tree(staged_entry)                        # complete on disk before it can be seen
        destination = self.entry_path(entry)
        destination.parent.mkdir(parents=True, exist_ok=True)
        if select:
            self._write_ref(entry, pending_over=self.default_version(entry.model_key) or "")
            self._publication_step("ref-pending")
        os.rename(staged_entry, destination)
        _sync_directory(destination.parent)
        self._publication_step("renamed")
        if select:
            self._write_ref(entry)
            self._publication_step("selected")
        return destination

    def _publication_step(self, step: str) -> None:
        """Called at each step of a publication (publishing, signed, ref-pending, renamed, selected): a
        seam where tests stop an export's process to check what each step leaves behind."""

    def _fresh_version(self, model_key: str) -> str:
        """A UTC timestamp, with a counter when several versions are published within one second."""
        stamp = datetime.datetime.now(datetime.timezone.utc).strftime("%Y%m%dT%H%M%SZ")
        version, suffix = stamp, 1
        while self.entry_path(EntryId(model_key, version)).exists():
            suffix += 1
            version = f"{stamp}-{suffix}"
        return version

    # --- refs ---------------------------------------------------------------------------------
    def default_version(self, model_key: str) -> str | None:
        """The selected version; a pending ref reads as its new version once that entry is published, as
        the previous default (or none) until then."""
        try:
            lines = (self.refs / model_key).read_text().splitlines()
        except FileNotFoundError:
            return None
        if not lines:
            return None
        if len(lines) >= 2 and not self._is_published(EntryId(model_key, lines[0].strip())):
            return lines[1].strip() or None
        return lines[0].strip() or None

    def _is_published(self, entry: EntryId) -> bool:
        return (self.entry_path(entry) / "model.safetensors").is_file()

    def _settle_ref(self, model_key: str) -> None:
        """Rewrite a stale pending ref (its publication died before its rename) as the one line it reads as."""
        try:
            lines = (self.refs / model_key).read_text().splitlines()
        except FileNotFoundError:
            return
        if len(lines) < 2:
            return
        version = self.default_version(model_key)
        if version is None:
            self.clear_default(model_key)
        else:
            self._write_ref(EntryId(model_key, version))

    def select(self, entry: EntryId) -> None:
        with self.lock(f"model-{entry.model_key}"):
            self._settle_ref(entry.model_key)
            if not self._is_published(entry):
                raise UsageError(f"{entry} is not a published entry in {self.root}; "
                                 "`flare models list` shows the versions there are")
            self._write_ref(entry)

    def clear_default(self, model_key: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            (self.refs / model_key).unlink()

    def _write_ref(self, entry: EntryId, pending_over: str | None = None) -> None:
        """Replace the model's ref atomically: `entry` selected, or (with `pending_over`, the previous
        default or "") pending until `entry` is published."""
        self.refs.mkdir(parents=True, exist_ok=True)
        temporary = self.refs / f".{entry.model_key}.{uuid.uuid4().hex}"
        text = entry.version + "\n" + (pending_over + "\n" if pending_over is not None else "")
        with open(temporary, "w") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
        os.replace(temporary, self.refs / entry.model_key)
        _sync_directory(self.refs)

    # --- listing and lookup -------------------------------------------------------------------
    def entries(self) -> list[EntryId]:
        if not self.models.is_dir():
            return []
        found = []
        for model_dir in sorted(self.models.iterdir()):
            for version_dir in sorted(model_dir.iterdir()) if model_dir.is_dir() else []:
                if (version_dir / "model.safetensors").is_file():
                    found.append(EntryId(model_dir.name, version_dir.name))
        return found

    def resolve(self, selector: str) -> EntryId:
        """MODEL or MODEL@VERSION to a published entry; MODEL alone names its selected default."""
        name, _, version = selector.partition("@")
        key = model_key_for(name)
        if not version:
            version = self.default_version(key)
            if version is None:
                known = sorted({entry.model_key for entry in self.entries()})
                raise UsageError(f"no selected version of {name!r} in {self.root}"
                                 + (f"; cached models: {', '.join(known)}" if known else
                                    "; the cache is empty — run `ignition export` first"))
        entry = EntryId(key, version)
        if not self._is_published(entry):
            raise UsageError(f"{entry} is not in {self.root}; `flare models list` shows what is")
        return entry

    def entry_for_path(self, path: Path) -> EntryId | None:
        """The entry a path inside models/ belongs to, or None for a path outside the cache."""
        try:
            relative = Path(path).resolve().relative_to(self.models.resolve())
        except ValueError:
            return None
        parts = relative.parts
        return EntryId(parts[0], parts[1]) if len(parts) >= 2 else None

    # --- leases -------------------------------------------------------------------------------
    def lease_path(self, entry: EntryId) -> Path:
        return self.locks / f"lease-{entry.model_key}@{entry.version}.lock"

    @contextlib.contextmanager
    def lease(self, entry: EntryId) -> Iterator[Path]:
        self.locks.mkdir(parents=True, exist_ok=True)
        with _flock(self.lease_path(entry), exclusive=False, wait=True):
            yield self.entry_path(entry)

    def is_leased(self, entry: EntryId) -> bool:
        try:
            with _flock(self.lease_path(entry), exclusive=True, wait=False):
                return False
        except BlockingIOError:
            return True

    # --- removal and collection ---------------------------------------------------------------
    def remove(self, entry: EntryId, clear_default: bool = False) -> None:
        path = self.entry_path(entry)
        if not path.is_dir():
            raise UsageError(f"{entry} is not in {self.root}; `flare models list` shows what is")
        with self.lock(f"model-{entry.model_key}"):
            self._settle_ref(entry.model_key)
            selected = self.default_version(entry.model_key) == entry.version
            if selected and not clear_default:
                raise UsageError(f"{entry} is the selected default of {entry.model_key}; select another "
                                 "version with `flare models select`, or pass --clear-default")
            self.locks.mkdir(parents=True, exist_ok=True)
            try:
                with _flock(self.lease_path(entry), exclusive=True, wait=False):
                    graveyard = self.staging / f"removed-{uuid.uuid4().hex}"
                    self.staging.mkdir(parents=True, exist_ok=True)
                    os.rename(path, graveyard)          # leaves models/ consistent even if rmtree stops
                    if selected:
                        self.clear_default(entry.model_key)
            except BlockingIOError:
                raise UsageError(f"{entry} is in use by a running process (it holds a lease); "
                                 "stop that server first") from None
        shutil.rmtree(graveyard, ignore_errors=True)
        with contextlib.suppress(OSError):
            path.parent.rmdir()                         # the model's directory, once empty

    def gc(self) -> dict:
        """Remove abandoned staging trees and blobs no entry links; return what was reclaimed."""
        removed_staging, reclaimed = [], 0
        if self.staging.is_dir():
            for tree in sorted(self.staging.iterdir()):
                try:
                    with _flock(self.locks / f"staging-{tree.name}.lock", exclusive=True, wait=False):
                        reclaimed += _tree_bytes_single_linked(tree)
                        shutil.rmtree(tree, ignore_errors=True)
                        removed_staging.append(tree.name)
                        (self.locks / f"staging-{tree.name}.lock").unlink(missing_ok=True)
                except BlockingIOError:
                    continue                            # an export is still building it
        removed_blobs = []
        if self.blobs.is_dir():
            with self.lock("blobs"):
                for blob in sorted(self.blobs.glob("*.safetensors")):
                    info = blob.stat()
                    if info.st_nlink == 1:
                        reclaimed += info.st_size
                        blob.unlink()
                        removed_blobs.append(blob.stem)
        return {"removed_staging": removed_staging, "removed_blobs": removed_blobs, "reclaimed_bytes": reclaimed}


def _sync_directory(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def _sync_tree(root: Path) -> None:
    """Flush every file and directory under `root` to disk, so a rename of it publishes complete bytes
    even across a crash (payload files are hard links to blobs: syncing either syncs both)."""
    for directory, _, names in os.walk(root):
        for name in names:
            descriptor = os.open(os.path.join(directory, name), os.O_RDONLY)
            try:
                os.fsync(descriptor)
            finally:
                os.close(descriptor)
        _sync_directory(Path(directory))


@contextlib.contextmanager
def _flock(path: Path, exclusive: bool, wait: bool) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    descriptor = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    try:
        flags = (fcntl.LOCK_EX if exclusive else fcntl.LOCK_SH) | (0 if wait else fcntl.LOCK_NB)
        fcntl.flock(descriptor, flags)
        yield
    finally:
        os.close(descriptor)                            # closing releases the lock


def _tree_bytes_single_linked(tree: Path) -> int:
    total = 0
    for path in tree.rglob("*"):
        with contextlib.suppress(OSError):
            info = path.lstat()
            if path.is_file() and info.st_nlink == 1:
                total += info.st_size
    return total


@contextlib.contextmanager
def lease_entry(path: Path, cache_root: Path | None = None) -> Iterator[Path]:
    """Hold a lease on the cache entry at `path` (a no-op for a package outside the cache).

    A running server wraps its whole life in this, so `flare models remove` refuses the entry.
    """
    path = Path(path)
    entry_dir = path if path.is_dir() else path.parent
    root = Path(cache_root) if cache_root else _cache_root_above(entry_dir)
    if root is None:
        yield path
        return
    cache = ModelCache(root)
    entry = cache.entry_for_path(entry_dir)
    if entry is None:
        yield path
        return
    with cache.lease(entry):
        yield path


def _cache_root_above(entry_dir: Path) -> Path | None:
    """models/<key>/<version> sits three levels under the cache root."""
    entry_dir = entry_dir.resolve()
    if len(entry_dir.parts) >= 4 and entry_dir.parent.parent.name == "models":
        return entry_dir.parent.parent.parent
    return None
