"""A small Hugging Face hub for tests: the endpoints huggingface_hub calls, served from memory on 127.0.0.1.

It answers what `HfApi.model_info`, `hf_hub_download` and `snapshot_download` send, the way the real hub
does (huggingface_hub 2.x):

* `GET /api/models/{repo}[/revision/{rev}]` (`?blobs=true` adds sizes): the commit (`sha`) and `siblings`;
* `GET /api/models/{repo}/tree/{rev}[/{path}]` (`?recursive=true`): the file listing `snapshot_download` uses;
* `HEAD|GET /{repo}/resolve/{rev}/{file}`: a plain file with `ETag` (its git blob id), `X-Repo-Commit` and
  `Content-Length`; a large-file-storage file (`*.safetensors`) as a 302 to a storage host (`localhost`
  instead of `127.0.0.1`, so the client treats it as off-hub) with `X-Linked-Etag` (sha256) and
  `X-Linked-Size`, as the hub's redirect to its CDN;
* `GET /cdn/{sha256}`: the storage host's body.

Errors carry the hub's `X-Error-Code` (`RepoNotFound`, `RevisionNotFound`, `EntryNotFound`), and a private
repository answers 401 to a request without its token, as the hub does. Repository ids match without regard
to casing. Every request is logged, and every file body served is counted, so tests can assert what crossed
the wire.
"""

from __future__ import annotations

import hashlib
import json
import secrets
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import parse_qs, unquote, urlsplit

import pytest

LFS_SUFFIXES = (".safetensors",)
LFS_POINTER_SIZE = 134


def git_blob_id(content: bytes) -> str:
    return hashlib.sha1(b"blob %d\0" % len(content) + content).hexdigest()


def fake_commit() -> str:
    return secrets.token_hex(20)


@dataclass(frozen=True)
class HubFile:
    path: str
    content: bytes

    @property
    def is_lfs(self) -> bool:
        return self.path.endswith(LFS_SUFFIXES)

    @property
    def sha256(self) -> str:
        return hashlib.sha256(self.content).hexdigest()

    @property
    def blob_id(self) -> str:
        return git_blob_id(self.content)

    def tree_entry(self) -> dict:
        entry = {"type": "file", "oid": self.blob_id, "size": len(self.content), "path": self.path}
        if self.is_lfs:
            entry["lfs"] = {"oid": self.sha256, "size": len(self.content), "pointerSize": LFS_POINTER_SIZE}
        return entry

    def sibling(self, with_blobs: bool) -> dict:
        if not with_blobs:
            return {"rfilename": self.path}
        sibling = {"rfilename": self.path, "size": len(self.content), "blobId": self.blob_id}
        if self.is_lfs:
            sibling["lfs"] = {"sha256": self.sha256, "size": len(self.content), "pointerSize": LFS_POINTER_SIZE}
        return sibling


@dataclass
class HubRepository:
    repo_id: str
    private: bool = False
    commits: dict[str, dict[str, HubFile]] = field(default_factory=dict)
    refs: dict[str, str] = field(default_factory=dict)  # branch or tag -> commit

    def commit_for(self, revision: str) -> str | None:
        if revision in self.commits:
            return revision
        return self.refs.get(revision)


@dataclass(frozen=True)
class LoggedRequest:
    method: str
    path: str
    authorization: str | None


class HubServer:
    """A hub on 127.0.0.1 in a background thread; `url` is the endpoint to give the client."""

    def __init__(self, token: str | None = None) -> None:
        self.token = token
        self.repositories: dict[str, HubRepository] = {}  # casefolded id -> repository
        self.requests: list[LoggedRequest] = []
        self.bodies_served: list[str] = []  # repository-relative paths of file bodies sent
        self._http = ThreadingHTTPServer(("127.0.0.1", 0), _handler_for(self))
        self._http.daemon_threads = True
        self._thread = threading.Thread(
            target=self._http.serve_forever, kwargs={"poll_interval": 0.05}, name="test-hub", daemon=True)

    @property
    def port(self) -> int:
        return self._http.server_address[1]

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self) -> HubServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._http.shutdown()
        self._http.server_close()

    def add_commit(
        self,
        repo_id: str,
        folder: Path,
        *,
        commit: str | None = None,
        refs: tuple[str, ...] = ("main",),
        private: bool = False,
    ) -> str:
        """Publish every file under `folder` as one commit of `repo_id`; `refs` (branches, tags) point at it."""
        repository = self.repositories.setdefault(repo_id.casefold(), HubRepository(repo_id, private))
        repository.private = repository.private or private
        commit = commit or fake_commit()
        files = {}
        for path in sorted(p for p in folder.rglob("*") if p.is_file()):
            relative = path.relative_to(folder).as_posix()
            files[relative] = HubFile(relative, path.read_bytes())
        repository.commits[commit] = files
        for ref in refs:
            repository.refs[ref] = commit
        return commit

    def clear_log(self) -> None:
        self.requests.clear()
        self.bodies_served.clear()

    @property
    def safetensors_bodies_served(self) -> list[str]:
        return [path for path in self.bodies_served if path.endswith(".safetensors")]

    def find_blob(self, sha256: str) -> HubFile | None:
        for repository in self.repositories.values():
            for files in repository.commits.values():
                for hub_file in files.values():
                    if hub_file.is_lfs and hub_file.sha256 == sha256:
                        return hub_file
        return None


class _HubError(Exception):
    def __init__(self, status: int, code: str | None, message: str, commit: str | None = None) -> None:
        super().__init__(message)
        self.status, self.code, self.message, self.commit = status, code, message, commit


def _handler_for(hub: HubServer) -> type[BaseHTTPRequestHandler]:
    class Handler(_HubHandler):
        pass

    Handler.hub = hub
    return Handler


class _HubHandler(BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"
    hub: HubServer

    def log_message(self, format: str, *args) -> None:  # keep test output quiet
        pass

    def do_GET(self) -> None:
        self._answer(send_body=True)

    def do_HEAD(self) -> None:
        self._answer(send_body=False)

    # -- dispatch -----------------------------------------------------------------------------------

    def _answer(self, send_body: bool) -> None:
        split = urlsplit(self.path)
        self.hub.requests.append(LoggedRequest(self.command, split.path, self.headers.get("Authorization")))
        query = parse_qs(split.query)
        segments = split.path.strip("/").split("/")
        try:
            if segments[0] == "cdn" and len(segments) == 2:
                self._send_blob(segments[1], send_body)
            elif segments[:2] == ["api", "models"] and len(segments) >= 4:
                self._check_credentials()
                self._api_model(segments[2:], query)
            elif len(segments) >= 5 and segments[2] == "resolve":
                self._check_credentials()
                self._resolve(segments, send_body)
            else:
                raise _HubError(404, None, "Not Found")
        except _HubError as error:
            self._send_error(error, send_body)

    def _check_credentials(self) -> None:
        sent = self.headers.get("Authorization")
        if sent is not None and sent != f"Bearer {self.hub.token}":
            raise _HubError(401, None, "Invalid credentials in Authorization header")

    def _repository(self, org: str, name: str) -> HubRepository:
        repository = self.hub.repositories.get(f"{unquote(org)}/{unquote(name)}".casefold())
        authorized = self.headers.get("Authorization") == f"Bearer {self.hub.token}"
        if repository is None or (repository.private and not authorized):
            # The hub answers a private repository as if it did not exist (401 for anonymous callers).
            status = 401 if repository is not None else 404
            raise _HubError(status, "RepoNotFound", "Repository not found")
        return repository

    def _commit(self, repository: HubRepository, revision: str) -> str:
        commit = repository.commit_for(unquote(revision))
        if commit is None:
            raise _HubError(404, "RevisionNotFound", f"Invalid rev id: {unquote(revision)}")
        return commit

    # -- /api/models/... ----------------------------------------------------------------------------

    def _api_model(self, segments: list[str], query: dict) -> None:
        repository = self._repository(segments[0], segments[1])
        rest = segments[2:]
        if not rest:
            self._model_info(repository, "main", query)
        elif rest[0] == "revision" and len(rest) == 2:
            self._model_info(repository, rest[1], query)
        elif rest[0] == "tree" and len(rest) >= 2:
            self._tree(repository, rest[1], "/".join(unquote(s) for s in rest[2:]), query)
        else:
            raise _HubError(404, None, "Not Found")

    def _model_info(self, repository: HubRepository, revision: str, query: dict) -> None:
        commit = self._commit(repository, revision)
        with_blobs = query.get("blobs", ["false"])[0].lower() == "true"
        files = repository.commits[commit].values()
        self._send_json(
            {
                "_id": git_blob_id(repository.repo_id.encode()),
                "id": repository.repo_id,
                "modelId": repository.repo_id,
                "sha": commit,
                "private": repository.private,
                "gated": False,
                "disabled": False,
                "tags": [],
                "siblings": [hub_file.sibling(with_blobs) for hub_file in files],
            }
        )

    def _tree(self, repository: HubRepository, revision: str, prefix: str, query: dict) -> None:
        commit = self._commit(repository, revision)
        recursive = query.get("recursive", ["false"])[0].lower() == "true"
        base = f"{prefix}/" if prefix else ""
        entries, folders = [], set()
        for path, hub_file in repository.commits[commit].items():
            if not path.startswith(base):
                continue
            parts = path[len(base) :].split("/")
            for depth in range(1, len(parts)):
                folders.add((base + "/".join(parts[:depth]), depth))
            if recursive or len(parts) == 1:
                entries.append(hub_file.tree_entry())
        for folder, depth in sorted(folders):
            if recursive or depth == 1:
                entries.append({"type": "directory", "oid": git_blob_id(folder.encode()), "size": 0, "path": folder})
        if prefix and not entries:
            raise _HubError(404, "EntryNotFound", f"{prefix} does not exist", commit)
        self._send_json(entries, commit=commit)

    # -- /{repo}/resolve/{rev}/{file} and the storage host -------------------------------------------

    def _resolve(self, segments: list[str], send_body: bool) -> None:
        repository = self._repository(segments[0], segments[1])
        commit = self._commit(repository, segments[3])
        filename = unquote("/".join(segments[4:]))
        hub_file = repository.commits[commit].get(filename)
        if hub_file is None:
            raise _HubError(404, "EntryNotFound", f"{filename} does not exist", commit)
        headers = {"X-Repo-Commit": commit, "ETag": f'"{hub_file.blob_id}"'}
        if hub_file.is_lfs:
            headers |= {
                "Location": f"http://localhost:{self.hub.port}/cdn/{hub_file.sha256}",
                "X-Linked-Etag": f'"{hub_file.sha256}"',
                "X-Linked-Size": str(len(hub_file.content)),
            }
            self._send(302, b"", headers, send_body)
            return
        if send_body:
            self.hub.bodies_served.append(filename)
        self._send(200, hub_file.content, headers, send_body)

    def _send_blob(self, sha256: str, send_body: bool) -> None:
        hub_file = self.hub.find_blob(sha256)
        if hub_file is None:
            raise _HubError(404, None, "No such blob")
        if send_body:
            self.hub.bodies_served.append(hub_file.path)
        self._send(200, hub_file.content, {"ETag": f'"{sha256}"'}, send_body)

    # -- responses ----------------------------------------------------------------------------------

    def _send_json(self, payload, commit: str | None = None) -> None:
        headers = {"Content-Type": "application/json"}
        if commit is not None:
            headers["X-Repo-Commit"] = commit
        self._send(200, json.dumps(payload).encode(), headers, send_body=True)

    def _send_error(self, error: _HubError, send_body: bool) -> None:
        headers = {"Content-Type": "application/json", "X-Error-Message": error.message}
        if error.code is not None:
            headers["X-Error-Code"] = error.code
        if error.commit is not None:
            headers["X-Repo-Commit"] = error.commit
        self._send(error.status, json.dumps({"error": error.message}).encode(), headers, send_body)

    def _send(self, status: int, body: bytes, headers: dict[str, str], send_body: bool) -> None:
        self.send_response(status)
        for name, value in headers.items():
            self.send_header(name, value)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if send_body and body:
            self.wfile.write(body)


# -- checkpoints to publish, and the fixture -------------------------------------------------------------


def write_safetensors(path: Path, tensor_bytes: int) -> None:
    """A valid safetensors file holding one float32 tensor of `tensor_bytes` bytes."""
    elements = tensor_bytes // 4
    header = json.dumps({"weight": {"dtype": "F32", "shape": [elements], "data_offsets": [0, elements * 4]}})
    header_bytes = header.encode().ljust((len(header) + 7) // 8 * 8)
    path.write_bytes(len(header_bytes).to_bytes(8, "little") + header_bytes + bytes(elements * 4))


def write_checkpoint(folder: Path, architecture: str = "LlamaForCausalLM", shards: int = 1,
                     shard_bytes: int = 4096, extra: dict[str, bytes] | None = None) -> Path:
    """A small Transformers-style checkpoint: config.json, a tokenizer file and safetensors weights.

    With `shards` > 1 the weights are split over `model-0000i-of-0000n.safetensors` with an index whose
    total_size is the tensor bytes.
    """
    folder.mkdir(parents=True, exist_ok=True)
    config = {"architectures": [architecture], "model_type": "llama", "hidden_size": 64, "vocab_size": 512}
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "tokenizer.json").write_text(json.dumps({"model": {"type": "BPE"}}))
    if shards == 1:
        write_safetensors(folder / "model.safetensors", shard_bytes)
    else:
        names = [f"model-{i:05d}-of-{shards:05d}.safetensors" for i in range(1, shards + 1)]
        for name in names:
            write_safetensors(folder / name, shard_bytes)
        weight_map = {f"w{i}": name for i, name in enumerate(names)}
        index = {"metadata": {"total_size": shards * shard_bytes}, "weight_map": weight_map}
        (folder / "model.safetensors.index.json").write_text(json.dumps(index))
    for name, content in (extra or {}).items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(content)
    return folder


TEST_TOKEN = "hf_testtoken"


@pytest.fixture
def hub():
    """A running test hub that accepts TEST_TOKEN for private repositories."""
    server = HubServer(token=TEST_TOKEN).start()
    yield server
    server.stop()
