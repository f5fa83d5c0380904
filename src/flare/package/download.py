"""Downloading published packages: a hub repository's prepared package into the Flare model cache.

    download("Org/Name[@REVISION]", DownloadOptions(...)) -> entry path
    resolve_package_target(PACKAGE, DownloadOptions(...)) -> entry or package path   (what `flare run` serves)

Online, the requested revision (the default branch `main` when none is given) is resolved to its commit
and everything is read from exactly that commit. The primary is selected among the repository's
`.safetensors` files, its signed envelope is verified (signature only: publisher trust is granted by
`flare run`, never here), and each payload the manifest names is taken from the Flare blob store when
an identical blob is already there, or else downloaded from the primary's directory through the hub
cache (the transport) and checked against its signed SHA-256. The entry is built under staging/ and
renamed into models/<model-key>/<version>/ exactly as export publishes, then selected as the model's
default, and the download is recorded (flare.package.sources) so offline resolution needs no network.

The transport cache lives under `<--cache-dir or the model cache>/transport`; a repository's part of it
is removed once its package is installed (the payloads live on as hard links in blobs/), and kept after
a failure so the next attempt resumes.
"""

from __future__ import annotations

import os
import posixpath
import re
import shutil
import stat
import sys
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, TextIO

from flare.errors import FetchError, FlareError, PreparationError, UsageError
from flare.package import format as fmt
from flare.package.manifest import Manifest, PayloadRecord
from flare.package.sources import SourceRecord, SourceRecords, envelope_sha256
from flare.package.store import EntryId, ModelCache, copy_range, model_key_for, sha256_file, try_hard_link

if TYPE_CHECKING:
    from flare.config import Config
    from flare.hub import HubOptions

DEFAULT_BRANCH = "main"
TRANSPORT_DIR = "transport"
REPOSITORY_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]*/[A-Za-z0-9][A-Za-z0-9._-]*")
_BLOB_NAME = re.compile(r"[0-9a-f]{64}\.safetensors")
_DATA_COMPANION = re.compile(r".*-data-\d+-of-\d+\.safetensors")
# Directories and files that hold an exported package's payloads, never a primary.
_COMPANION_DIRS = ("weights", "deployments")
_COMPANION_FILES = (fmt.FRONTEND_PAYLOAD,)


@dataclass(frozen=True)
class DownloadOptions:
    """The download flags (spec "Downloading published packages"), shared by `flare download` and `flare run`."""

    config: Config | None = None          # None: the default configuration file
    revision: str | None = None           # --revision: wins over REPOSITORY@REVISION
    filename: str | None = None           # --filename: the repository-relative primary
    cache_dir: Path | None = None         # --cache-dir: parent of the transport cache
    token_file: Path | None = None        # --token-file: wins over [hub] token_file
    offline: bool = False
    model_cache: Path | None = None       # --model-cache: wins over [paths] package_cache
    gpus: tuple[int, ...] | None = None   # --gpus: its length selects the tensor-parallel deployment

    @property
    def configuration(self) -> Config:
        if self.config is not None:
            return self.config
        from flare.config import load_config
        return load_config(None)

    @property
    def cache_root(self) -> Path:
        from flare.config import package_cache

        return package_cache(self.model_cache, self.configuration)

    @property
    def transport_dir(self) -> Path:
        return Path(self.cache_dir or self.cache_root).expanduser() / TRANSPORT_DIR

    @property
    def tensor_parallel(self) -> int | None:
        return len(self.gpus) if self.gpus else None

    @property
    def download_flags(self) -> list[str]:
        """The download-only flags that were given (refused for local package paths)."""
        return [flag for flag, value in (("--revision", self.revision), ("--filename", self.filename),
                                         ("--cache-dir", self.cache_dir), ("--token-file", self.token_file))
                if value is not None]

    def hub_options(self) -> HubOptions:
        """Endpoint and token from the configuration (the token file read now), the transport as hub cache."""
        from flare.hub import HubOptions
        options = HubOptions.from_config(self.configuration, token_file=self.token_file)
        return replace(options, cache_dir=self.transport_dir)


def parse_repository(text: str, revision: str | None = None) -> tuple[str, str | None]:
    """ORG/NAME[@REVISION] as (repository id, revision); an explicit `revision` (--revision) wins."""
    repo_id, at, embedded = text.partition("@")
    if not REPOSITORY_ID.fullmatch(repo_id) or (at and not embedded):
        raise UsageError(f"{text!r} is not a hub repository; give ORG/NAME or ORG/NAME@REVISION")
    return repo_id, revision or embedded or None


# -- what other components call -------------------------------------------------------------------------


def download(repository: str, options: DownloadOptions, stream: TextIO | None = None) -> Path:
    """Install (or find) the prepared package of a repository revision in the model cache; return the entry.

    Online: resolve the revision's commit and acquire from exactly that commit. Offline: only the recorded
    download origins are read, and no request is made.
    """
    stream = stream or sys.stderr
    repo_id, revision = parse_repository(repository, options.revision)
    if revision is None:
        _say(stream, f"{repo_id}: no revision given; using the default branch {DEFAULT_BRANCH}")
        revision = DEFAULT_BRANCH
    if options.offline:
        return _resolve_offline(repo_id, revision, options, stream)
    return _acquire(repo_id, revision, options, stream)


def resolve_package_target(target: str | Path, options: DownloadOptions, stream: TextIO | None = None) -> Path:
    """What `flare run PACKAGE` serves, in the specification's order.

    1. An existing path, an absolute path, ./… or ../…, or a *.safetensors name: a local package (download
       flags are refused; --offline is accepted).
    2. MODEL[@VERSION] of a model in the cache: that version, else the selected default. A default that was
       downloaded is first checked against its recorded repository and revision (unless --offline); an
       unchanged commit transfers nothing, a changed one is acquired and verified before the default switches.
    3. Otherwise ORG/NAME[@REVISION]: the repository's package is downloaded and its entry returned.
    """
    stream = stream or sys.stderr
    text = str(target)
    path = Path(text).expanduser()
    if is_local_path(text):
        if options.download_flags:
            raise UsageError(f"{', '.join(options.download_flags)} apply to repository downloads, and {text} "
                             "is a local package path; drop them or name a repository ORG/NAME")
        if not path.exists():
            raise no_package_error(path)
        return path
    cache = ModelCache(options.cache_root)
    name, _, version = text.partition("@")
    key = _cached_key_or_none(cache, name)
    if key is not None and _is_cached_model(cache, key):
        return _resolve_cached_model(cache, key, name, version, options, stream)
    if REPOSITORY_ID.fullmatch(name):
        return download(text, options, stream)
    raise UsageError(f"{text} is not a package path, a model in {cache.root}, or a hub repository ORG/NAME; "
                     "`flare models list` shows the cached models")


def is_local_path(text: str) -> bool:
    """Whether a PACKAGE argument names a path: existing paths, absolute ones, ./… and ../…, and *.safetensors."""
    path = Path(text).expanduser()
    return path.exists() or path.is_absolute() or text.startswith(("./", "../")) or text.endswith(".safetensors")


def no_package_error(path: Path) -> UsageError:
    return UsageError(f"no package at {path}; check the path, or name a cached model as MODEL[@VERSION] "
                      "(`flare models list` shows them)")


# -- cached models (flare run) --------------------------------------------------------------------------


def _model_key_or_none(name: str) -> str | None:
    try:
        return model_key_for(name)
    except UsageError:
        return None


def _cached_key_or_none(cache: ModelCache, name: str) -> str | None:
    """The model's cache key, also when `name` is one of its served aliases (`flare run demo`)."""
    from flare.package.listing import model_key_for_name

    try:
        return model_key_for_name(cache, name)
    except UsageError:
        return None


def _is_cached_model(cache: ModelCache, key: str) -> bool:
    return (cache.models / key).is_dir() or (cache.refs / key).is_file()


def _resolve_cached_model(cache: ModelCache, key: str, name: str, version: str, options: DownloadOptions,
                          stream: TextIO) -> Path:
    overrides = [flag for flag in options.download_flags if flag in ("--revision", "--filename")]
    if version:                                         # explicit versions stay pinned
        if overrides:
            raise UsageError(f"{' and '.join(overrides)} cannot override the explicit local version "
                             f"{name}@{version}; name the model without @VERSION")
        return cache.entry_path(cache.resolve(f"{key}@{version}"))
    selected = cache.default_version(key)
    if selected is None:
        raise UsageError(f"{name} is in {cache.root} but has no selected version; choose one with "
                         "`flare models select MODEL@VERSION` (`flare models list` shows them)")
    origin = SourceRecords(cache).origin_of(EntryId(key, selected))
    if origin is None:
        if overrides:
            raise UsageError(f"{name} was exported locally and has no download origin; "
                             f"{' and '.join(overrides)} apply to models downloaded from a repository")
        return cache.entry_path(cache.resolve(key))
    if options.offline:
        return cache.entry_path(cache.resolve(key))
    return _update(cache, key, name, origin, options, stream)


def _update(cache: ModelCache, key: str, name: str, origin: SourceRecord, options: DownloadOptions,
            stream: TextIO) -> Path:
    """Check a downloaded default's recorded repository and revision; switch only to a verified update."""
    revision = options.revision or origin.requested_revision
    filename = options.filename or origin.requested_filename
    _say(stream, f"{name}: checking {origin.repository}@{revision} for an update")
    try:
        return _acquire(origin.repository, revision, replace(options, filename=filename), stream,
                        expected_model_key=key)
    except FlareError as error:
        if options.revision or options.filename:
            raise                                       # an explicit source that fails is the answer
        selected = cache.resolve(key)
        _say(stream, f"warning: the update check failed ({error}); serving the selected {selected}")
        return cache.entry_path(selected)


# -- offline --------------------------------------------------------------------------------------------


def _resolve_offline(repo_id: str, revision: str, options: DownloadOptions, stream: TextIO) -> Path:
    cache = ModelCache(options.cache_root)
    record = SourceRecords(cache).find(repo_id, revision, options.filename)
    request = f"{repo_id}@{revision}" + (f" --filename {options.filename}" if options.filename else "")
    if record is None:
        how = ("with that --filename" if options.filename else "that selected its package file automatically")
        raise FetchError(f"{request}: {cache.root} has no recorded download {how}, and --offline makes no "
                         f"network requests; run `flare download {repo_id}"
                         f"{'@' + revision if revision != DEFAULT_BRANCH else ''}` online first")
    if record.envelope_sha256 is None:
        raise FetchError(f"{request}: its recorded download is not bound to a signed envelope; refresh it "
                         f"online with `flare download {repo_id}`, or load a cached entry by its path")
    entry_dir = cache.entry_path(record.entry)
    if not (entry_dir / fmt.PRIMARY_NAME).is_file():
        raise FetchError(f"{request}: the recorded entry {record.entry} is no longer in {cache.root}; "
                         f"download it again online with `flare download {repo_id}`")
    if envelope_sha256(entry_dir) != record.envelope_sha256:
        raise PreparationError(f"{request}: the entry {record.entry} differs from the signed envelope recorded "
                               "when it was downloaded; the default is unchanged — download it again online")
    manifest = _verify_entry(entry_dir, hash_payloads=True)
    _check_tensor_parallel(manifest, options.tensor_parallel, f"{record.entry}")
    _say(stream, f"{request}: commit {record.commit}, cached as {record.entry}")
    cache.select(record.entry)
    return entry_dir


# -- online ---------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Installed:
    entry: EntryId
    filename: str
    envelope_sha256: str


def _acquire(repo_id: str, revision: str, options: DownloadOptions, stream: TextIO,
             expected_model_key: str | None = None) -> Path:
    from flare import hub

    hub_options = options.hub_options()
    cache = ModelCache(options.cache_root)
    records = SourceRecords(cache)
    commit = hub.resolve_revision(repo_id, revision, hub_options)
    _say(stream, f"{repo_id}@{revision}: commit {commit}")
    installed = _already_installed(cache, records.find_commit(repo_id, commit, options.filename), options,
                                   expected_model_key)
    if installed is not None:
        _say(stream, f"{repo_id}@{commit[:12]} is already cached as {installed.entry}; nothing to transfer")
    with cache.lock(f"download-{model_key_for(repo_id.casefold())}"):       # one transfer per repository
        if installed is None:
            installed = _install(repo_id, commit, options, hub_options, cache, stream, expected_model_key)
        _remove_transport(repo_id, hub_options.cache_dir)
    cache.select(installed.entry)
    records.add(SourceRecord(repository=repo_id, requested_revision=revision, requested_filename=options.filename,
                             commit=commit, filename=installed.filename, tensor_parallel=options.tensor_parallel,
                             model_key=installed.entry.model_key, version=installed.entry.version,
                             envelope_sha256=installed.envelope_sha256))
    return cache.entry_path(installed.entry)


def _already_installed(cache: ModelCache, record: SourceRecord | None, options: DownloadOptions,
                       expected_model_key: str | None) -> _Installed | None:
    """The entry an earlier download of this commit installed, if it is still intact."""
    if record is None or record.envelope_sha256 is None:
        return None
    entry_dir = cache.entry_path(record.entry)
    if not (entry_dir / fmt.PRIMARY_NAME).is_file() or envelope_sha256(entry_dir) != record.envelope_sha256:
        return None
    try:
        manifest = _verify_entry(entry_dir, hash_payloads=False)
    except FlareError:
        return None                                     # damaged: acquire it again
    _check_model(manifest, expected_model_key, record.repository)
    _check_tensor_parallel(manifest, options.tensor_parallel, str(record.entry))
    return _Installed(record.entry, record.filename, record.envelope_sha256)


@dataclass(frozen=True)
class _Remote:
    """One repository at one commit: its files and sizes, and the directory of the selected primary."""

    repo_id: str
    commit: str
    files: dict[str, int]
    primary: str
    hub_options: HubOptions

    @property
    def where(self) -> str:
        return f"{self.repo_id}@{self.commit}"

    def companion(self, payload_name: str) -> str:
        """Companions resolve from the primary's directory at the same commit."""
        return posixpath.join(posixpath.dirname(self.primary), payload_name)

    def download(self, filename: str) -> Path:
        from flare import hub
        return hub.download_file(self.repo_id, self.commit, filename, self.hub_options)


def _install(repo_id: str, commit: str, options: DownloadOptions, hub_options: HubOptions, cache: ModelCache,
             stream: TextIO, expected_model_key: str | None) -> _Installed:
    from flare import hub

    files = hub.repository_files(repo_id, commit, hub_options)
    remote = _Remote(repo_id, commit, files, select_primary(files, options.filename, f"{repo_id}@{commit}"),
                     hub_options)
    _say(stream, f"{remote.where}: downloading {remote.primary} ({_size(files[remote.primary])})")
    downloaded = remote.download(remote.primary)
    with cache.staging_tree() as staging:
        received = staging / "received" / fmt.PRIMARY_NAME
        _place(downloaded, received)
        package = _read_package(received, f"{remote.where}: {remote.primary}")
        manifest = _verify_envelope(package, f"{remote.where}: {remote.primary}")
        _check_model(manifest, expected_model_key, repo_id)
        _check_tensor_parallel(manifest, options.tensor_parallel, remote.where)
        entry = EntryId(manifest.model_key, manifest.version)
        tree = staging / "entry"
        tree.mkdir()
        if package.form == "packed":
            fmt.write_primary(tree / fmt.PRIMARY_NAME, package.primary)
        else:
            os.rename(received, tree / fmt.PRIMARY_NAME)
        envelope = envelope_sha256(tree)
        if _is_cached(cache, entry, envelope):
            _say(stream, f"{remote.where}: already cached as {entry}; nothing more to transfer")
            return _Installed(entry, remote.primary, envelope)
        received_payloads = [record for record in manifest.payloads
                             if _receive_payload(record, package, remote, cache, tree, stream)]
        for record in received_payloads:               # only once every payload matched its signed hash
            cache.store_payload(tree / record.name, record.sha256)
        _publish(cache, tree, entry, envelope)
    _say(stream, f"{remote.where}: installed {entry}")
    return _Installed(entry, remote.primary, envelope)


def _is_cached(cache: ModelCache, entry: EntryId, envelope: str) -> bool:
    """Whether the cache already holds this exact entry; a different package under its name is an error."""
    existing = cache.entry_path(entry)
    if not (existing / fmt.PRIMARY_NAME).is_file():
        return False
    if envelope_sha256(existing) != envelope:
        raise FetchError(f"{cache.root} already holds a different package as {entry}; remove it with "
                         f"`flare models remove {entry}` to download this one")
    _verify_entry(existing, hash_payloads=False)
    return True


def _receive_payload(record: PayloadRecord, package: fmt.PackageFiles, remote: _Remote, cache: ModelCache,
                     tree: Path, stream: TextIO) -> bool:
    """Put one payload into the entry tree: linked from an identical cached blob (False), or received from
    the packed primary or the hub and checked against its signed hash (True: it still goes into blobs/)."""
    target = tree / record.name
    target.parent.mkdir(parents=True, exist_ok=True)
    if cache.has_blob(record.sha256):
        _check_cached_blob(cache.blob_path(record.sha256), record)
        cache.link_blob(record.sha256, target)         # the same bytes are cached already: no transfer
        return False
    companion = remote.companion(record.name)
    if package.form == "packed":
        location = package.locate(record)
        with open(target, "wb") as sink:
            copy_range(location.path, location.offset, record.size, sink)
    else:
        if companion not in remote.files:
            raise FetchError(f"{remote.where} lacks {companion}, which the signed manifest of its package names; "
                             "the repository's upload is incomplete")
        if remote.files[companion] != record.size:
            raise FetchError(f"{remote.where}: {companion} is {remote.files[companion]} bytes, the signed manifest "
                             f"records {record.size}; the repository does not hold the package it signed")
        _say(stream, f"{remote.where}: downloading {companion} ({_size(record.size)})")
        _place(remote.download(companion), target)
    digest = sha256_file(target)
    if target.stat().st_size != record.size or digest != record.sha256:
        raise FetchError(f"{remote.where}: {companion} differs from the signed manifest (SHA-256 {digest}, "
                         f"signed {record.sha256}); nothing was installed")
    return True


def _check_cached_blob(blob: Path, record: PayloadRecord) -> None:
    """A cached payload object must be a regular file of the signed size (its bytes are hashed when served)."""
    info = blob.lstat()
    if not stat.S_ISREG(info.st_mode) or info.st_size != record.size:
        what = "not a regular file" if not stat.S_ISREG(info.st_mode) else f"{info.st_size} bytes"
        raise PreparationError(f"the cached payload object {blob} is {what}, but payload {record.name} is "
                               f"{record.size} bytes; remove that file and run `flare models gc`, then "
                               "download again")


def _publish(cache: ModelCache, tree: Path, entry: EntryId, envelope: str) -> None:
    """Rename the finished tree into models/ as export publishes; selecting it is the caller's last step."""
    try:
        cache.publish(tree, entry, select=False)
    except UsageError:
        if not _is_cached(cache, entry, envelope):     # an identical entry published meanwhile is fine
            raise


def _remove_transport(repo_id: str, transport: Path) -> None:
    """Drop a repository's transport files once its package is installed; the payloads live on in blobs/."""
    from flare.hub import repo_folder_name

    for folder in (transport / repo_folder_name(repo_id), transport / ".locks" / repo_folder_name(repo_id)):
        shutil.rmtree(folder, ignore_errors=True)


def remove_abandoned_transports(cache: ModelCache, transport: Path | None = None) -> tuple[list[str], int]:
    """Remove what failed downloads left in the transport cache (default `<cache>/transport`), skipping a
    repository whose download is running now; returns the repositories' folder names and the bytes freed."""
    import filelock

    transport = transport or cache.root / TRANSPORT_DIR
    removed, reclaimed = [], 0
    for folder in sorted(transport.glob("models--*")) if transport.is_dir() else []:
        repo_id = folder.name.removeprefix("models--").replace("--", "/", 1)
        try:
            with cache.lock(f"download-{model_key_for(repo_id.casefold())}").acquire(timeout=0):
                reclaimed += sum(p.lstat().st_size for p in folder.rglob("*") if p.is_file() and not p.is_symlink())
                _remove_transport(repo_id, transport)
                removed.append(folder.name)
        except filelock.Timeout:
            continue                                    # being downloaded right now
    return removed, reclaimed


# -- the repository's files -----------------------------------------------------------------------------


def select_primary(files: dict[str, int], filename: str | None, where: str) -> str:
    """The package primary among a repository's files: --filename, else the sole candidate.

    Payload blobs (<sha256>.safetensors), data companions (*-data-NN-of-NN.safetensors) and the payload
    files of a directory-form package (frontend.safetensors, weights/…, deployments/…) are never primaries;
    a .safetensors file beside a config.json belongs to a Transformers checkpoint.
    """
    if filename is not None:
        if filename not in files:
            found = _candidates(files)
            raise FetchError(f"{where} has no file {filename}"
                             + (f"; its package files: {', '.join(found)}" if found else ""))
        return filename
    candidates = _candidates(files)
    checkpoints = [name for name in candidates if posixpath.join(posixpath.dirname(name), "config.json") in files]
    candidates = [name for name in candidates if name not in checkpoints]
    if not candidates:
        if checkpoints:
            raise UsageError(f"{where} holds a Transformers checkpoint, not a prepared Flare package; prepare "
                             "it with `ignition export`, or download a repository of exported packages")
        raise FetchError(f"{where} holds no prepared Flare package (no package .safetensors file)")
    if len(candidates) > 1:
        raise UsageError(f"{where} holds several package files ({', '.join(candidates)}); choose one with "
                         "--filename FILE")
    return candidates[0]


def _candidates(files: dict[str, int]) -> list[str]:
    return sorted(name for name in files if _is_primary_candidate(name))


def _is_primary_candidate(name: str) -> bool:
    parts = name.split("/")
    base = parts[-1]
    return (base.endswith(".safetensors") and not _BLOB_NAME.fullmatch(base)
            and not _DATA_COMPANION.fullmatch(base) and base not in _COMPANION_FILES
            and not any(part in _COMPANION_DIRS for part in parts[:-1]))


# -- verification ---------------------------------------------------------------------------------------


def _read_package(path: Path, where: str) -> fmt.PackageFiles:
    try:
        return fmt.read_package_files(path)
    except PreparationError as error:
        raise FetchError(f"{where} is not a usable Flare package: {error}") from None


def _verify_envelope(package: fmt.PackageFiles, where: str) -> Manifest:
    """Check the signature (with the embedded profile or a known key). Every name in the manifest is safe
    to use as a cache path: its schema refused it when it was read otherwise.

    Signature only: whether this publisher may run code is decided by `flare run`.
    """
    from flare.package.trust import TrustOptions, verify_signature

    manifest = package.primary.manifest
    try:
        verify_signature(package.primary.manifest_body, package.primary.signature, manifest,
                         package.primary.profile_json, TrustOptions(offline=True, require_acceptance=False), where)
    except PreparationError as error:
        raise FetchError(f"{error}; nothing was installed") from None
    return manifest


def _verify_entry(entry_dir: Path, hash_payloads: bool) -> Manifest:
    """A cached entry's signature and payload layout (and, when asked, every payload's hash)."""
    from flare.package import verify
    from flare.package.trust import TrustOptions, verify_signature

    package = fmt.read_package_files(entry_dir)
    manifest = package.primary.manifest
    verify_signature(package.primary.manifest_body, package.primary.signature, manifest, package.primary.profile_json,
                     TrustOptions(offline=True, require_acceptance=False), str(package.primary_path))
    verify.check_layout(package, manifest.payloads)
    if hash_payloads:
        verify.verify_payloads(package, manifest.payloads)
    return manifest


def _check_model(manifest: Manifest, expected_model_key: str | None, repository: str) -> None:
    if expected_model_key is not None and manifest.model_key != expected_model_key:
        raise UsageError(f"{repository} now holds {manifest.model_id}, not {expected_model_key}; the update "
                         "is rejected and the default is unchanged")


def _check_tensor_parallel(manifest: Manifest, tensor_parallel: int | None, where: str) -> None:
    sizes = sorted({deployment.tensor_parallel for deployment in manifest.deployments})
    if tensor_parallel is not None and tensor_parallel not in sizes:
        raise UsageError(f"{where} is prepared for tensor-parallel size {', '.join(map(str, sizes)) or 'none'}; "
                         f"--gpus names {tensor_parallel} GPUs")


# -- files ----------------------------------------------------------------------------------------------


def _place(source: Path, target: Path) -> None:
    """Put a transported file at `target`: a hard link to the file a snapshot entry points at, or a copy
    when the transport is on another filesystem."""
    resolved = Path(source).resolve()
    target.parent.mkdir(parents=True, exist_ok=True)
    if not try_hard_link(resolved, target):
        shutil.copyfile(resolved, target)


def _size(count: int) -> str:
    from flare.ui.progress import format_bytes
    return format_bytes(count)


def _say(stream: TextIO, line: str) -> None:
    print(line, file=stream, flush=True)
