"""Write a prepared model as a signed cache entry: payloads into blobs, the manifest into the primary.

`export_entry` needs no model code: weights come straight from the checkpoint's safetensors, grouped
per semantic layer and cast to the plan's dtype. Everything is built under staging/ and published by
one rename, so a failure at any point publishes nothing.
"""

from __future__ import annotations

import datetime
import errno
import json
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from flare.errors import PreparationError, UsageError
from flare.package import format as fmt
from flare.package import safetensors_io as st
from flare.package import verify
from flare.package import weights as wt
from flare.package.manifest import (DRAFT_WEIGHTS, Checkpoint, Deployment, Frontend, GraphCatalog, License,
                                    Manifest, PayloadRecord, Plan, Preparation, Publisher, Rank, Recipe, Sampling)
from flare.package.signing import SigningIdentity
from flare.package.store import EntryId, ModelCache, model_key_for

WEIGHT_MODES = ("normal", "no-weights", "reuse-weights")
WRITE_WORKERS = 4                  # payloads prepared at once: each holds one layer's tensors in memory


@dataclass(frozen=True)
class ExportSpec:
    """Everything the manifest records about a prepared model, decided before export."""

    model_id: str                                  # canonical model id, e.g. "stories260k"
    served_names: tuple[str, ...]
    checkpoint_dir: Path
    hf_config: dict
    plan: Plan                                     # dtype, page size, prefill chunk, capacities, tensor parallel
    preparation: Preparation                       # device and phase record
    graphs: GraphCatalog                           # the captured graph catalog (empty on CPU)
    recipe_name: str | None = None
    recipe_alias: str | None = None
    checkpoint_repo: str | None = None
    checkpoint_revision: str | None = None
    repository: str | None = None                  # Hugging Face target of the package (--repo-id)
    sampling: Sampling = field(default_factory=lambda: Sampling({}, {}))
    license: License | None = None
    compiled: "object | None" = None                 # flare.engine.compile_cache.CompiledArtifacts (GPU only)
    draft_dir: Path | None = None                  # a learned draft's checkpoint: its weights become draft payloads


@dataclass(frozen=True)
class ExportHooks:
    """Optional observers: called after each payload is stored, and with counts for progress lines."""

    on_payload: Callable[[str, int, bool], None] | None = None   # (name, size, reused)


def export_entry(spec: ExportSpec, cache: ModelCache, identity: SigningIdentity,
                 weight_mode: str = "normal", reuse_from: "object | None" = None,
                 hooks: ExportHooks = ExportHooks(), select: bool = True) -> Path:
    """Publish `spec` as a new version in `cache`; return the entry's directory."""
    if weight_mode not in WEIGHT_MODES:
        raise UsageError(f"unknown weight mode {weight_mode!r}")
    model_key = model_key_for(spec.model_id)
    try:
        return _export_staged(spec, cache, identity, model_key, weight_mode, reuse_from, hooks, select)
    except OSError as error:
        if error.errno not in (errno.ENOSPC, errno.EDQUOT):
            raise
        raise PreparationError(
            f"the disk holding the model cache {cache.root} is full ({error.strerror.lower()} while writing "
            f"{error.filename or 'a payload'}); nothing was published. `flare models gc` removes what this and "
            "earlier unfinished exports left behind; then free space there or set [paths] package_cache to a "
            "larger disk") from None


def _export_staged(spec: ExportSpec, cache: ModelCache, identity: SigningIdentity, model_key: str,
                   weight_mode: str, reuse_from, hooks: ExportHooks, select: bool) -> Path:
    with cache.staging_tree() as staging:
        tree = staging / "entry"
        tree.mkdir()
        payloads = []
        if weight_mode == "reuse-weights":
            payloads += _reuse_weights(spec, cache, tree, reuse_from, hooks)
        else:
            payloads += _write_weights(spec, cache, tree, weight_mode == "no-weights", hooks)
        if spec.draft_dir is not None:
            if weight_mode == "reuse-weights":
                raise UsageError("--reuse-weights takes the target's payloads from a cached version and cannot "
                                 "take a learned draft's; export without it, or with --no-mtp")
            payloads += _write_weights(spec, cache, tree, weight_mode == "no-weights", hooks, draft=True)
        payloads.append(_store(cache, tree, fmt.FRONTEND_PAYLOAD, "frontend", _frontend_tensors(spec), hooks))
        tensor_parallel = spec.plan.tensor_parallel
        deployment = f"tp{tensor_parallel}"
        ranks = []
        for rank in range(tensor_parallel):
            name = f"deployments/{deployment}/rank-{rank}/graphs.safetensors"
            tensors, metadata = _module_global(spec)
            payloads.append(_store(cache, tree, name, "module-global", tensors, hooks, metadata=metadata))
            ranks.append(Rank(rank, (name,)))
        deployments = (Deployment(deployment, tensor_parallel, tuple(ranks)),)

        def sign_as(version: str) -> None:               # the version is part of the signed manifest
            manifest = _manifest(spec, EntryId(model_key, version), identity, payloads, deployments)
            write_signed_primary(tree, manifest, identity)

        return cache.publish_new_version(tree, model_key, sign_as, select=select)


def write_signed_primary(tree: Path, manifest: Manifest, identity: SigningIdentity) -> None:
    body = manifest.to_json()
    primary = fmt.Primary(body, identity.sign(body.encode()), identity.profile.to_json(), "directory")
    fmt.write_primary(tree / fmt.PRIMARY_NAME, primary)


def _write_weights(spec: ExportSpec, cache: ModelCache, tree: Path, require_cached: bool,
                   hooks: ExportHooks, draft: bool = False) -> list[PayloadRecord]:
    """Each layer's payload read, cast, hashed and written by a few workers at once (each step releases
    the GIL: the cast in torch, the hash, the write), then stored and reported in checkpoint order. With
    `draft`, the learned draft's checkpoint, into payloads under `weights/draft/` (in the plan's dtype)."""
    files = wt.checkpoint_tensor_files(spec.draft_dir if draft else spec.checkpoint_dir)
    groups = [(DRAFT_WEIGHTS + payload.removeprefix("weights/") if draft else payload, names)
              for payload, names in wt.group_by_payload(files).items()]
    online_fp8 = None if draft else wt.online_fp8_of(spec.plan)
    failed = threading.Event()          # once one payload fails, the workers start no other

    def write(group: tuple[str, list[str]]) -> PayloadRecord:
        if failed.is_set():
            raise _Abandoned()
        try:
            return write_payload(*group)
        except BaseException:
            failed.set()
            raise

    def write_payload(payload: str, names: list[str]) -> PayloadRecord:
        path = tree / payload
        path.parent.mkdir(parents=True, exist_ok=True)
        sha256, size = st.write(path, wt.read_checkpoint_group(names, files, spec.plan.dtype, online_fp8))
        tensors, sample = verify.describe_weight_payload(path, size)     # read back from the page cache
        return PayloadRecord(payload, "weights", sha256, size, tensors, sample)

    records = []
    with ThreadPoolExecutor(max_workers=WRITE_WORKERS, thread_name_prefix="flare-export") as workers:
        for record in workers.map(write, groups):
            records.append(_register(cache, tree, record, hooks, require_cached))
    return records


class _Abandoned(Exception):
    """A payload not started because an earlier one failed. Payloads start in checkpoint order, so the
    results, read in that order, raise the failure itself first."""


def _reuse_weights(spec: ExportSpec, cache: ModelCache, tree: Path, source,
                   hooks: ExportHooks) -> list[PayloadRecord]:
    """Link the weight payloads of the model's verified default version, after checking they fit."""
    if source is None:
        raise PreparationError(f"--reuse-weights needs a cached default version of {spec.model_id}; "
                               "run a normal export first")
    old = source.manifest
    mismatches = [what for what, ours, theirs in (
        ("recipe", spec.recipe_name, old.recipe.name),
        ("checkpoint revision", spec.checkpoint_revision, old.checkpoint.revision),
        ("dtype", spec.plan.dtype, old.plan.dtype),
        ("online FP8 projections", spec.plan.online_fp8, old.plan.online_fp8),
        ("tensor-parallel size", spec.plan.tensor_parallel, old.plan.tensor_parallel),
        ("checkpoint config", spec.hf_config, old.checkpoint.config)) if ours != theirs]
    files = wt.checkpoint_tensor_files(spec.checkpoint_dir)
    groups = wt.group_by_payload(files)
    reused = old.weight_payloads()
    if {record.name for record in reused} != set(groups):
        mismatches.append("weight payload layout")
    if mismatches:
        raise PreparationError(f"--reuse-weights: the cached default version {source.label} differs in "
                               f"{', '.join(mismatches)}; export without --reuse-weights")
    for record in reused:
        planned = wt.planned_tensors(groups[record.name], files, spec.plan.dtype, wt.online_fp8_of(spec.plan))
        _check_reused_tensors(record, planned, source.label)
    for record in reused:
        if not cache.has_blob(record.sha256):
            raise PreparationError(f"--reuse-weights: payload {record.name} ({record.sha256[:12]}…) is "
                                   "missing from the cache; export without --reuse-weights")
        cache.link_blob(record.sha256, tree / record.name)
        if hooks.on_payload:
            hooks.on_payload(record.name, record.size, True)
    return list(reused)


def _check_reused_tensors(record: PayloadRecord, planned: tuple, label: str) -> None:
    """A reused payload must hold exactly the tensors this export would write: the same names, stored
    dtypes, shapes (payload tensors are contiguous, so the same strides) and placement."""
    if record.tensors is None:
        raise PreparationError(f"--reuse-weights: the cached default version {label} records no tensor list for "
                               f"{record.name} (it was exported before tensor lists were signed), so its shapes "
                               "cannot be compared; export without --reuse-weights")
    for cached, wanted in zip(record.tensors, planned):
        if cached != wanted:
            raise PreparationError(
                f"--reuse-weights: {record.name} of the cached default version {label} holds {cached.name} as "
                f"{cached.dtype} {list(cached.shape)} at {list(cached.data_offsets)}; this export writes "
                f"{wanted.name} as {wanted.dtype} {list(wanted.shape)} at {list(wanted.data_offsets)}. "
                "Export without --reuse-weights")
    if len(record.tensors) != len(planned):
        raise PreparationError(f"--reuse-weights: {record.name} of the cached default version {label} holds "
                               f"{len(record.tensors)} tensors; this export writes {len(planned)}. "
                               "Export without --reuse-weights")


def _store(cache: ModelCache, tree: Path, name: str, kind: str, tensors, hooks: ExportHooks,
           metadata: dict | None = None, require_cached: bool = False) -> PayloadRecord:
    path = tree / name
    path.parent.mkdir(parents=True, exist_ok=True)
    sha256, size = st.write(path, tensors, metadata)
    return _register(cache, tree, PayloadRecord(name, kind, sha256, size), hooks, require_cached)


def _register(cache: ModelCache, tree: Path, record: PayloadRecord, hooks: ExportHooks,
              require_cached: bool = False) -> PayloadRecord:
    """Link a written payload to its blob and report it; return its manifest record."""
    if require_cached and not cache.has_blob(record.sha256):
        raise PreparationError(f"--no-weights: weight payload {record.name} ({record.sha256[:12]}…) is not cached; "
                               "export once without --no-weights")
    reused = cache.store_payload(tree / record.name, record.sha256)
    if hooks.on_payload:
        hooks.on_payload(record.name, record.size, reused)
    return record


def _module_global(spec: ExportSpec) -> tuple[list[st.TensorBytes], dict[str, str]]:
    """A rank's module-global payload: the graph catalog, and the compiled kernels when prepared on a GPU."""
    metadata = {fmt.GRAPH_CATALOG_METADATA: spec.graphs.to_json()}
    if spec.compiled is None:
        return [], metadata
    metadata[fmt.COMPILE_KEY_METADATA] = json.dumps(spec.compiled.key, sort_keys=True)
    parts = {fmt.COMPILED_ARTIFACTS_TENSOR: spec.compiled.data, fmt.TRITON_KERNELS_TENSOR: spec.compiled.triton_kernels,
             fmt.FLASHINFER_KERNELS_TENSOR: spec.compiled.flashinfer_kernels}
    return [st.TensorBytes(name, "U8", (len(data),), data) for name, data in parts.items() if data], metadata


def _frontend_tensors(spec: ExportSpec) -> list[st.TensorBytes]:
    names = fmt.frontend_asset_names(spec.checkpoint_dir)
    if "tokenizer.json" not in names and "tokenizer.model" not in names:
        raise PreparationError(f"{spec.checkpoint_dir} has no tokenizer.json; a package needs its tokenizer")
    tensors = []
    for name in names:
        data = (Path(spec.checkpoint_dir) / name).read_bytes()
        tensors.append(st.TensorBytes(name, "U8", (len(data),), data))
    return tensors


def _manifest(spec: ExportSpec, entry: EntryId, identity: SigningIdentity, payloads: list[PayloadRecord],
              deployments: tuple[Deployment, ...]) -> Manifest:
    return Manifest(
        format_version=fmt.FORMAT_VERSION, model_key=entry.model_key, version=entry.version,
        model_id=spec.model_id, served_names=tuple(spec.served_names),
        recipe=Recipe(spec.recipe_name, spec.recipe_alias),
        checkpoint=Checkpoint(spec.checkpoint_repo, spec.checkpoint_revision, spec.hf_config),
        repository=spec.repository, plan=spec.plan, sampling=spec.sampling, license=spec.license,
        publisher=publisher_record(identity), created=utc_now(), preparation=spec.preparation,
        frontend=Frontend(fmt.FRONTEND_PAYLOAD, tuple(fmt.frontend_asset_names(spec.checkpoint_dir))),
        deployments=deployments, payloads=tuple(payloads))


def publisher_record(identity: SigningIdentity) -> Publisher:
    return Publisher(identity.namespace, identity.official_source, identity.public_key.fingerprint)


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
