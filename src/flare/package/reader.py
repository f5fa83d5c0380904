"""Opening a package to serve it: verify the signature, decide trust, check payloads, expose contents.

    package = open_package(path_or_selector, TrustOptions(...), cache_root=...)
    package.manifest                  the signed manifest (flare.package.manifest.Manifest)
    package.iter_weights()            (checkpoint tensor name, tensor) for every weight, memory-mapped
    package.frontend_dir()            a temporary directory holding tokenizer.json, configs, templates
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator

from flare.errors import UsageError
from flare.package import format as fmt
from flare.package import safetensors_io as st
from flare.package import verify
from flare.package import weights as wt
from flare.package.manifest import DRAFT_WEIGHTS, GraphCatalog, Manifest, PayloadRecord, Plan
from flare.package.download import is_local_path, no_package_error
from flare.package.store import DEFAULT_CACHE_ROOT, ModelCache
from flare.package.trust import TrustOptions, TrustResult, authorize, verify_signature


_ASSET_NAME = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]*")     # frontend assets are written by these names


@dataclass
class Package:
    """A verified package: its signature, and its stored bytes as far as `stored_data` says (frontend and
    module-global bytes hashed; weight payloads' sizes, headers and sampled hashes; all weight bytes only
    with --verify-weights)."""

    path: Path
    files: fmt.PackageFiles
    manifest: Manifest
    trust: TrustResult | None                      # None only for unverified inspection
    frontend_assets: dict[str, bytes]
    graph_catalogs: dict[str, GraphCatalog]        # deployment payload name -> catalog
    stored_data: verify.StoredDataCheck | None = None   # what was checked of the bytes (None: unverified)
    _frontend_tmp: Path | None = None

    @property
    def form(self) -> str:
        return self.files.form

    @property
    def label(self) -> str:
        return self.manifest.label

    @property
    def hf_config(self) -> dict:
        return self.manifest.checkpoint.config

    @property
    def plan(self) -> Plan:
        return self.manifest.plan

    @property
    def served_names(self) -> list[str]:
        return list(self.manifest.served_names)

    @property
    def payloads(self) -> tuple[PayloadRecord, ...]:
        return self.manifest.payloads

    def weight_payloads(self) -> tuple[PayloadRecord, ...]:
        return self.manifest.weight_payloads()

    def iter_weights(self, pinned: bool = False, draft: bool = False) -> Iterator[tuple[str, object]]:
        """Every weight under its checkpoint name, as a CPU tensor mapped from the payload file; with
        `pinned`, read into page-locked buffers instead (for a GPU: see `weights.iter_tensors_pinned`).
        The target's weights, or with `draft` the learned draft's (`manifest.DRAFT_WEIGHTS` payloads)."""
        locations = []
        for record in self.weight_payloads():
            if record.name.startswith(DRAFT_WEIGHTS) != draft:
                continue
            location = self.files.locate(record)
            locations.append((location.path, location.offset, record.size, f"payload {record.name}"))
        if pinned:
            yield from wt.iter_tensors_pinned(locations)
            return
        for location in locations:
            yield from wt.iter_tensors(*location)

    def compiled_artifacts(self, rank: int = 0) -> tuple[bytes, dict, bytes, bytes] | None:
        """The torch.compile artifacts prepared for `rank` of the first deployment, the environment key
        they were made with, the packed Triton kernels and FlashInfer builds (b"" if none), read
        hash-checked; None when the package was prepared without a GPU."""
        deployment = self.manifest.deployments[0]
        name = next(r.payloads[0] for r in deployment.ranks if r.rank == rank)
        tensors, metadata = _decode(verify.read_verified(self.files, self.manifest.payload(name)), name)
        if fmt.COMPILE_KEY_METADATA not in metadata:
            return None
        return (tensors.get(fmt.COMPILED_ARTIFACTS_TENSOR, b""), json.loads(metadata[fmt.COMPILE_KEY_METADATA]),
                tensors.get(fmt.TRITON_KERNELS_TENSOR, b""), tensors.get(fmt.FLASHINFER_KERNELS_TENSOR, b""))

    def frontend_dir(self) -> Path:
        """Materialise the frontend assets into a temporary directory (removed by `close`)."""
        if self._frontend_tmp is None:
            directory = Path(tempfile.mkdtemp(prefix="flare-frontend-"))
            for name, data in self.frontend_assets.items():
                (directory / name).write_bytes(data)
            self._frontend_tmp = directory
        return self._frontend_tmp

    def close(self) -> None:
        if self._frontend_tmp is not None:
            shutil.rmtree(self._frontend_tmp, ignore_errors=True)
            self._frontend_tmp = None

    def __enter__(self) -> "Package":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def resolve_target(target: str | Path, cache_root: Path | None = None) -> Path:
    """A package path, or MODEL[@VERSION] in the cache. Existing paths win, as do ./, ../ and absolute paths."""
    text = str(target)
    path = Path(text).expanduser()
    if is_local_path(text):
        if not path.exists():
            raise no_package_error(path)
        return path
    from flare.package.listing import model_key_for_name

    cache = ModelCache(cache_root or DEFAULT_CACHE_ROOT)
    name, at, version = text.partition("@")
    return cache.entry_path(cache.resolve(model_key_for_name(cache, name) + at + version))


def open_package(target: str | Path, trust: TrustOptions | None = None, cache_root: Path | None = None,
                 on_verify_bytes: Callable[[int], None] | None = None, stream=None) -> Package:
    """Verify and open a package for serving; raises before anything is served if any check fails."""
    trust = trust or TrustOptions()
    path = resolve_target(target, cache_root)
    files = fmt.read_package_files(path)
    primary = files.primary
    manifest = primary.manifest
    key, source = verify_signature(primary.manifest_body, primary.signature, manifest, primary.profile_json,
                                   trust, str(files.primary_path))
    result = authorize(manifest, key, source, trust, stream)
    frontend, catalogs, checked = verify_stored_data(files, trust.verify_weights, on_verify_bytes)
    return Package(path, files, manifest, result, frontend, catalogs, checked)


def open_unverified(target: str | Path, cache_root: Path | None = None) -> Package:
    """Decode the primary's metadata only: no keys, no signature check, no companion files."""
    path = resolve_target(target, cache_root)
    files = fmt.read_package_files(path)
    return Package(path, files, files.primary.manifest, None, {}, {})


def verify_stored_data(files: fmt.PackageFiles, full_hash: bool = False,
                       on_bytes: Callable[[int], None] | None = None,
                       payloads: tuple[PayloadRecord, ...] | None = None,
                       ) -> tuple[dict[str, bytes], dict[str, GraphCatalog], verify.StoredDataCheck]:
    """What every load checks of a package whose signature verified (sizes, the small payloads' hashes,
    the weight payloads' headers and sampled hashes; with `full_hash` every weight byte): the frontend
    assets, the graph catalogs, and an account of what was checked. `payloads` narrows the checks to
    those a copy holds (one rank's, `flare.package.rank_copy`); None: every payload the manifest lists."""
    manifest = files.manifest
    payloads = manifest.payloads if payloads is None else payloads
    verify.check_layout(files, payloads)
    frontend, catalogs = read_small_payloads(files, payloads)
    weights = tuple(record for record in payloads if record.kind == "weights")
    sampled_bytes = sum(verify.check_weight_payload(files, record) for record in weights)
    if full_hash:
        verify.verify_payloads(files, weights, on_bytes)
    checked = verify.StoredDataCheck(
        payloads=len(payloads), hashed_small=len(payloads) - len(weights),
        weight_payloads=len(weights), headers_recorded=sum(r.tensors is not None for r in weights),
        sampled=sum(r.sample is not None for r in weights), sampled_bytes=sampled_bytes,
        weight_bytes=sum(r.size for r in weights), weights_hashed=full_hash)
    return frontend, catalogs, checked


def read_small_payloads(files: fmt.PackageFiles, payloads: tuple[PayloadRecord, ...]
                        ) -> tuple[dict[str, bytes], dict[str, GraphCatalog]]:
    """Frontend assets and graph catalogs of `payloads`, from bytes whose hashes were just checked."""
    frontend: dict[str, bytes] = {}
    catalogs: dict[str, GraphCatalog] = {}
    for record in (r for r in payloads if r.kind in ("frontend", "module-global")):
        data = verify.read_verified(files, record)
        tensors, metadata = _decode(data, record.name)
        if record.kind == "frontend":
            for asset in tensors:
                if not _ASSET_NAME.fullmatch(asset):
                    raise UsageError(f"{files.primary_path}: frontend asset {asset!r} is not a plain file name; "
                                     "the package is malformed and cannot be used")
            frontend.update(tensors)
        else:
            catalogs[record.name] = GraphCatalog.from_json(metadata.get(fmt.GRAPH_CATALOG_METADATA, ""),
                                                           f"payload {record.name}")
    return frontend, catalogs


def _decode(data: bytes, name: str) -> tuple[dict[str, bytes], dict[str, str]]:
    import io
    header = st.read_header(io.BytesIO(data), 0, len(data), what=f"payload {name}")
    return {entry.name: data[entry.start:entry.end] for entry in header.tensors}, header.metadata
