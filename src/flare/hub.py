"""The Hugging Face hub: checkpoint metadata, revisions and snapshots, with Flare's own endpoint, token and cache.

Flare reads no environment variables (spec section 1), so every call passes the endpoint, the token (or
`False`, meaning "send none") and the cache directory explicitly, and `_library()` resets the switches
huggingface_hub took from HF_* variables when it was imported. The hub cache keeps the library's layout
(`models--org--name/{blobs,refs,snapshots}`), so snapshots other tools downloaded are reused and ours are
theirs.
"""

from __future__ import annotations

import glob
import json
import re
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from flare.errors import FetchError, UsageError

if TYPE_CHECKING:
    from flare.config import Config

DEFAULT_ENDPOINT = "https://huggingface.co"
DEFAULT_HUB_CACHE = Path("~/.cache/huggingface/hub")
CONFIG_NAME = "config.json"
INDEX_NAME = "model.safetensors.index.json"
SAFETENSORS_SUFFIX = ".safetensors"
# Weights in formats Flare does not load, and the consolidated copies some repositories carry beside the
# Transformers shards (Llama's original/): a snapshot is complete without them, so they are never downloaded.
IGNORED_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.gguf", "*.onnx", "*.h5", "*.msgpack", "original/*")
_COMMIT = re.compile(r"[0-9a-f]{40}")


def is_commit(revision: str | None) -> bool:
    return revision is not None and _COMMIT.fullmatch(revision) is not None


@dataclass(frozen=True)
class HubOptions:
    """Where and how to reach the hub. Built from the configuration, never from HF_* variables."""

    endpoint: str = DEFAULT_ENDPOINT
    token: str | None = field(default=None, repr=False)
    cache_dir: Path = DEFAULT_HUB_CACHE
    offline: bool = False  # make no request; only complete cached snapshots serve

    def __post_init__(self) -> None:
        object.__setattr__(self, "endpoint", self.endpoint.rstrip("/"))
        object.__setattr__(self, "cache_dir", Path(self.cache_dir).expanduser())

    @classmethod
    def from_config(cls, config: Config, *, token_file: Path | None = None, offline: bool = False) -> HubOptions:
        """Options from `[hub]` and `[paths] hub_cache`; an explicit `token_file` (a flag) wins over the file's."""
        from flare.config import TOKEN_FILE, resolve

        chosen = resolve(TOKEN_FILE, token_file, config).value
        token = read_token_file(Path(chosen)) if chosen else None
        return cls(endpoint=config.hub.endpoint, token=token, cache_dir=config.paths.hub_cache, offline=offline)

    @property
    def library_token(self) -> str | bool:
        """The token argument for huggingface_hub: ours, or False so it never looks for one of its own."""
        return self.token if self.token else False


def read_token_file(path: Path) -> str:
    path = path.expanduser()
    try:
        token = path.read_text(encoding="utf-8").strip()
    except OSError as error:
        raise UsageError(f"cannot read the hub token file {path}: {error.strerror or error}") from error
    if not token:
        raise UsageError(f"the hub token file {path} is empty; write the token into it or drop the setting")
    return token


# -- what a checkpoint holds ----------------------------------------------------------------------------


@dataclass(frozen=True)
class WeightsInfo:
    """The safetensors files a checkpoint needs and the bytes they store (the index's total_size when given)."""

    files: tuple[str, ...]
    total_bytes: int


@dataclass(frozen=True)
class RepositoryMetadata:
    """A repository read at one commit without its tensors."""

    repo_id: str
    revision: str  # the commit
    requested_revision: str | None  # what the caller asked for (a branch, a tag, the commit, or None)
    hf_config: dict
    weights: WeightsInfo
    snapshot: Path | None  # the complete cached snapshot it was read from, if one existed


def read_json(path: Path, what: str) -> dict:
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise UsageError(f"cannot read {what} {path}: {error}") from error
    if not isinstance(data, dict):
        raise UsageError(f"{what} {path} is not a JSON object")
    return data


def _weights_from_index(index: dict, where: str, sizes: dict[str, int]) -> WeightsInfo:
    weight_map = index.get("weight_map")
    if not isinstance(weight_map, dict) or not weight_map:
        raise UsageError(f"the safetensors index of {where} has no weight_map")
    files = tuple(sorted(set(weight_map.values())))
    total = (index.get("metadata") or {}).get("total_size")
    if not isinstance(total, int):
        total = sum(sizes.get(name, 0) for name in files)
    return WeightsInfo(files, total)


def local_weights(directory: Path) -> WeightsInfo | None:
    """The weights of a checkpoint directory: from its index, else its top-level safetensors files."""
    index_path = directory / INDEX_NAME
    if index_path.is_file():
        index = read_json(index_path, "the safetensors index")
        sizes = {p.name: p.stat().st_size for p in directory.glob(f"*{SAFETENSORS_SUFFIX}") if p.is_file()}
        return _weights_from_index(index, str(directory), sizes)
    files = sorted(p for p in directory.glob(f"*{SAFETENSORS_SUFFIX}") if p.is_file())
    if not files:
        return None
    return WeightsInfo(tuple(p.name for p in files), sum(p.stat().st_size for p in files))


def missing_checkpoint_files(directory: Path) -> list[str]:
    """What a checkpoint directory lacks: config.json, an index's shards, or any safetensors weights."""
    if not directory.is_dir():
        return [CONFIG_NAME]
    missing = [] if (directory / CONFIG_NAME).is_file() else [CONFIG_NAME]
    try:
        weights = local_weights(directory)
    except UsageError:
        return missing + [INDEX_NAME]
    if weights is None:
        return missing + [f"*{SAFETENSORS_SUFFIX}"]
    return missing + [name for name in weights.files if not (directory / name).is_file()]


# -- the hub cache --------------------------------------------------------------------------------------


def repo_folder_name(repo_id: str) -> str:
    return "models--" + repo_id.replace("/", "--")


def _repo_folders(repo_id: str, cache_dir: Path) -> list[Path]:
    """Cache folders of this repository, the exact-case one first, then those differing only in casing."""
    wanted = repo_folder_name(repo_id)
    if not cache_dir.is_dir():
        return []
    variants = sorted(
        p for p in cache_dir.iterdir() if p.name != wanted and p.name.casefold() == wanted.casefold() and p.is_dir()
    )
    exact = cache_dir / wanted
    return ([exact] if exact.is_dir() else []) + variants


def _folder_repo_id(folder: Path) -> str:
    return folder.name.removeprefix("models--").replace("--", "/", 1)


def _missing_from_recorded_tree(folder: Path, commit: str, snapshot: Path) -> list[str]:
    """Files huggingface_hub recorded for this commit (when it listed the repository) that the snapshot lacks."""
    try:  # the recorded tree arrived in huggingface_hub 2.x; older caches simply have none
        from huggingface_hub import get_cached_repo_tree
        from huggingface_hub.errors import CachedRepoTreeNotFoundError
    except ImportError:
        return []
    try:
        tree = get_cached_repo_tree(_folder_repo_id(folder), revision=commit, cache_dir=folder.parent)
    except (CachedRepoTreeNotFoundError, OSError, ValueError):
        return []
    weights = local_weights(snapshot)
    expected = needed_files([entry.path for entry in tree], weights.files if weights else ())
    return [path for path in expected if not (snapshot / path).is_file()]


def needed_files(repository_files: list[str], indexed: tuple[str, ...]) -> list[str]:
    """The files of a repository a complete snapshot holds.

    All but IGNORED_PATTERNS, and, beside a safetensors index, only the top-level safetensors files it
    names: some repositories also carry one consolidated copy of every weight (Mistral's
    consolidated.safetensors), which would double the download.
    """
    from huggingface_hub.utils import filter_repo_objects

    kept = filter_repo_objects(repository_files, ignore_patterns=list(IGNORED_PATTERNS))
    has_index = INDEX_NAME in repository_files
    return [name for name in kept if not (has_index and _is_top_level_weights(name) and name not in indexed)]


def _is_top_level_weights(name: str) -> bool:
    return name.endswith(SAFETENSORS_SUFFIX) and "/" not in name


def snapshot_missing_files(folder: Path, commit: str) -> list[str]:
    snapshot = folder / "snapshots" / commit
    return missing_checkpoint_files(snapshot) or _missing_from_recorded_tree(folder, commit, snapshot)


def find_complete_snapshot(repo_id: str, commit: str, cache_dir: Path) -> Path | None:
    """A complete cached snapshot of exactly this commit, in any casing of the repository's folder.

    The exact-case folder is tried first; an incomplete snapshot there does not hide a complete one in a
    folder whose name differs only in casing. Other commits are never considered.
    """
    for folder in _repo_folders(repo_id, cache_dir):
        if not snapshot_missing_files(folder, commit):
            return folder / "snapshots" / commit
    return None


def _cached_commit(repo_id: str, revision: str, cache_dir: Path) -> str | None:
    """The commit a branch or tag last resolved to, as the cache's refs recorded it."""
    for folder in _repo_folders(repo_id, cache_dir):
        ref = folder / "refs" / revision
        if ref.is_file():
            commit = ref.read_text(encoding="utf-8").strip()
            if is_commit(commit):
                return commit
    return None


# -- the library, under our settings --------------------------------------------------------------------


def _library():
    """huggingface_hub with the switches it read from HF_* variables at import set by Flare instead.

    Endpoint, token and cache are arguments of every call; these are the module-level switches that would
    otherwise refuse requests (HF_HUB_OFFLINE: offline is our option, honoured by making no request), send
    side requests to the library's default endpoint (telemetry and its user-agent probe), or change how
    files are transferred, laid out and timed. They match `flare.environment`, which sets the variables
    when Flare gets to run before the library is imported; this covers the case where it did not.
    """
    import huggingface_hub
    from huggingface_hub import constants

    constants.HF_HUB_OFFLINE = False
    constants.HF_HUB_DISABLE_TELEMETRY = True
    constants.HF_HUB_DISABLE_IMPLICIT_TOKEN = True
    constants.HF_HUB_DISABLE_SYMLINKS = False
    constants.HF_HUB_DISABLE_XET = True  # plain resumable HTTP, as the specification's acquisition uses
    constants.HF_HUB_ETAG_TIMEOUT = constants.DEFAULT_ETAG_TIMEOUT
    constants.HF_HUB_DOWNLOAD_TIMEOUT = constants.DEFAULT_DOWNLOAD_TIMEOUT
    return huggingface_hub


def _where(repo_id: str, revision: str | None) -> str:
    return f"{repo_id}@{revision}" if revision else repo_id


@contextmanager
def _fetch_errors(repo_id: str, revision: str | None, options: HubOptions) -> Iterator[None]:
    """Turn the library's failures into a FetchError naming the repository, the revision and the hub."""
    from huggingface_hub import errors

    prefix = f"cannot fetch {_where(repo_id, revision)} from {options.endpoint}"
    token_hint = "" if options.token else "; if it is private or gated, give a token with [hub] token_file"
    try:
        yield
    except errors.GatedRepoError as error:
        gated = "the repository is gated: accept its terms on the hub and use a token that has access"
        raise FetchError(f"{prefix}: {gated}") from error
    except errors.RepositoryNotFoundError as error:
        raise FetchError(f"{prefix}: the hub has no repository {repo_id}{token_hint}") from error
    except errors.RevisionNotFoundError as error:
        raise FetchError(f"{prefix}: {repo_id} has no revision {revision}") from error
    except errors.RemoteEntryNotFoundError as error:
        raise FetchError(f"{prefix}: a file is missing ({_first_line(error)})") from error
    except errors.HfHubHTTPError as error:
        status = error.response.status_code if error.response is not None else "an error"
        hint = "; check the token in [hub] token_file" if status in (401, 403) else ""
        raise FetchError(f"{prefix}: the hub answered {status}{hint}") from error
    except (OSError, errors.LocalEntryNotFoundError) as error:
        raise FetchError(f"{prefix}: {_first_line(error)}") from error
    except Exception as error:
        if _is_transport_error(error):
            raise FetchError(f"{prefix}: the hub is unreachable ({_first_line(error)})") from error
        raise


def _is_transport_error(error: Exception) -> bool:
    # huggingface_hub's HTTP client raises its own transport errors (httpx2 in 2.x); find them by name
    # so this module does not depend on which client it uses.
    return any(cls.__name__ in ("TransportError", "HTTPError") for cls in type(error).__mro__)


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return text.splitlines()[0] if text else type(error).__name__


def _model_info(repo_id: str, revision: str | None, options: HubOptions):
    hub = _library()
    api = hub.HfApi(endpoint=options.endpoint, token=options.library_token)
    with _fetch_errors(repo_id, revision, options):
        return api.model_info(repo_id, revision=revision, files_metadata=True)


def _download_file(repo_id: str, commit: str, filename: str, options: HubOptions) -> Path:
    hub = _library()
    with _fetch_errors(repo_id, commit, options):
        path = hub.hf_hub_download(
            repo_id,
            filename,
            revision=commit,
            cache_dir=options.cache_dir,
            endpoint=options.endpoint,
            token=options.library_token,
        )
    return Path(path)


def _refuse_offline(repo_id: str, revision: str | None, options: HubOptions, what: str) -> None:
    if options.offline:
        raise FetchError(
            f"{_where(repo_id, revision)}: {what} in the hub cache {options.cache_dir}, "
            "and offline mode makes no requests"
        )


# -- what other modules call ----------------------------------------------------------------------------


def resolve_revision(repo_id: str, revision: str | None, options: HubOptions) -> str:
    """The commit a branch, tag or commit names (None: the default branch). A full commit costs no request."""
    if is_commit(revision):
        return revision
    if options.offline:
        commit = _cached_commit(repo_id, revision or "main", options.cache_dir)
        if commit is None:
            _refuse_offline(repo_id, revision, options, "no recorded commit for this revision")
        return commit
    commit = _model_info(repo_id, revision, options).sha
    _record_ref(repo_id, revision, commit, options.cache_dir)
    return commit


def _record_ref(repo_id: str, revision: str | None, commit: str, cache_dir: Path) -> None:
    """Remember what a branch or tag resolved to, in the cache's refs, so offline runs can follow it."""
    if is_commit(revision):
        return
    ref = cache_dir / repo_folder_name(repo_id) / "refs" / (revision or "main")
    ref.parent.mkdir(parents=True, exist_ok=True)
    ref.write_text(commit, encoding="utf-8")


def read_repository(repo_id: str, revision: str | None, options: HubOptions) -> RepositoryMetadata:
    """config.json and the weights' files and size at a revision, without downloading any tensor.

    A complete cached snapshot of the commit answers without a request; otherwise the hub's file listing
    gives the sizes, and only config.json and the safetensors index are downloaded (into the hub cache).
    """
    commit = revision if is_commit(revision) else None
    if commit is None and options.offline:
        commit = resolve_revision(repo_id, revision, options)
    if commit is not None:
        snapshot = find_complete_snapshot(repo_id, commit, options.cache_dir)
        if snapshot is not None:
            config = read_json(snapshot / CONFIG_NAME, "the checkpoint configuration")
            return RepositoryMetadata(repo_id, commit, revision, config, local_weights(snapshot), snapshot)
        _refuse_offline(repo_id, revision, options, "no complete snapshot")
    info = _model_info(repo_id, revision, options)
    _record_ref(repo_id, revision, info.sha, options.cache_dir)
    return _read_remote(repo_id, info, revision, options)


def _remote_index_files(repo_id: str, commit: str, options: HubOptions) -> tuple[str, ...]:
    index = read_json(_download_file(repo_id, commit, INDEX_NAME, options), "the safetensors index")
    return _weights_from_index(index, f"{repo_id} at commit {commit}", {}).files


def _read_remote(repo_id: str, info, revision: str | None, options: HubOptions) -> RepositoryMetadata:
    commit = info.sha
    sizes = {sibling.rfilename: sibling.size or 0 for sibling in info.siblings or []}
    where = f"{repo_id} at commit {commit}"
    if CONFIG_NAME not in sizes:
        raise UsageError(f"{where} has no {CONFIG_NAME}; Flare serves Transformers checkpoints")
    config = read_json(_download_file(repo_id, commit, CONFIG_NAME, options), "the checkpoint configuration")
    if INDEX_NAME in sizes:
        index = read_json(_download_file(repo_id, commit, INDEX_NAME, options), "the safetensors index")
        weights = _weights_from_index(index, where, sizes)
    else:
        files = sorted(name for name in sizes if name.endswith(SAFETENSORS_SUFFIX) and "/" not in name)
        if not files:
            raise UsageError(f"{where} has no safetensors weights; Flare loads safetensors checkpoints only")
        weights = WeightsInfo(tuple(files), sum(sizes[name] for name in files))
    return RepositoryMetadata(repo_id, commit, revision, config, weights, None)


def download_snapshot(repo_id: str, commit: str, options: HubOptions) -> Path:
    """A complete local snapshot of exactly `commit`: a cached one (any casing) if complete, else downloaded."""
    if not is_commit(commit):
        raise ValueError(f"download_snapshot needs a full commit hash, not {commit!r}")
    snapshot = find_complete_snapshot(repo_id, commit, options.cache_dir)
    if snapshot is not None:
        return snapshot
    _refuse_offline(repo_id, commit, options, "no complete snapshot")
    # The listing first: it reports a missing repository, revision or token clearly (the download itself
    # would fall back to whatever partial snapshot is cached), and says which files to fetch.
    names = [sibling.rfilename for sibling in _model_info(repo_id, commit, options).siblings or []]
    indexed = _remote_index_files(repo_id, commit, options) if INDEX_NAME in names else ()
    hub = _library()
    with _fetch_errors(repo_id, commit, options):
        path = Path(
            hub.snapshot_download(
                repo_id,
                revision=commit,
                cache_dir=options.cache_dir,
                endpoint=options.endpoint,
                token=options.library_token,
                allow_patterns=[glob.escape(name) for name in needed_files(names, indexed)],
            )
        )
    missing = snapshot_missing_files(path.parent.parent, commit)
    if missing:
        raise FetchError(
            f"the download of {repo_id}@{commit} from {options.endpoint} is incomplete: "
            f"{', '.join(missing[:5])} missing in {path}"
        )
    return path


def repository_files(repo_id: str, commit: str, options: HubOptions) -> dict[str, int]:
    """Every file of a repository at exactly `commit`, with its size in bytes (one listing request)."""
    if not is_commit(commit):
        raise ValueError(f"repository_files needs a full commit hash, not {commit!r}")
    _refuse_offline(repo_id, commit, options, "no file listing")
    return {sibling.rfilename: sibling.size or 0 for sibling in _model_info(repo_id, commit, options).siblings or []}


def download_file(repo_id: str, commit: str, filename: str, options: HubOptions) -> Path:
    """One file of exactly `commit`, through the hub cache; no request when its snapshot already holds it.

    The returned path is the snapshot's entry (a symbolic link into the cache's blobs where links work).
    """
    if not is_commit(commit):
        raise ValueError(f"download_file needs a full commit hash, not {commit!r}")
    _refuse_offline(repo_id, commit, options, f"{filename} is not cached")
    return _download_file(repo_id, commit, filename, options)
