"""`flare models list`: each cached model, its versions and their storage figures.

Listing decodes manifests without verifying signatures (it says so). Storage figures count inodes,
so hard links shared between entries and blobs are never double-counted:
    logical_bytes          unique payload lengths named by the manifest
    disk_logical_bytes     apparent sizes of the entry tree's unique inodes
    disk_physical_bytes    allocated blocks of those inodes (st_blocks * 512)
    shared_*               the part in inodes with more than one link
    reclaimable_bytes      what removing the entry and running gc frees, or null with a note
"""

from __future__ import annotations

import os
from pathlib import Path

from flare.errors import FlareError, UsageError
from flare.package import format as fmt
from flare.package.manifest import Manifest
from flare.package.store import EntryId, ModelCache


def list_models(cache: ModelCache, model: str | None = None) -> dict:
    from flare.package.store import model_key_for
    wanted = model_key_for(model.partition("@")[0]) if model else None
    models: dict[str, dict] = {}
    for entry in cache.entries():
        if wanted and entry.model_key != wanted:
            continue
        record = models.setdefault(entry.model_key, {"model_key": entry.model_key,
                                                     "default": cache.default_version(entry.model_key),
                                                     "versions": []})
        record["versions"].append(describe_entry(cache, entry, record["default"]))
    return {"cache": str(cache.root), "verification": "unverified", "models": list(models.values())}


def model_key_for_name(cache: ModelCache, name: str) -> str:
    """The cache key MODEL names: the model's own key when the cache holds it, else the model whose
    selected version serves `name` as an alias (`flare inspect demo` finds flare-demo). Read from the
    unverified manifests; whoever opens the entry then verifies it. A name no model serves is returned
    as its key, for the caller's "not in the cache" error."""
    from flare.package.store import model_key_for

    key = model_key_for(name)
    if (cache.models / key).is_dir() or (cache.refs / key).is_file():
        return key
    serving = sorted({entry.model_key for entry in cache.entries()
                      if entry.version == cache.default_version(entry.model_key)
                      and name.casefold() in _served_names(cache, entry)})
    if len(serving) > 1:
        raise UsageError(f"{name} is a served name of {' and '.join(serving)}; name the model itself")
    return serving[0] if serving else key


def _served_names(cache: ModelCache, entry: EntryId) -> set[str]:
    try:
        manifest = fmt.read_package_files(cache.entry_path(entry)).primary.manifest
    except FlareError:
        return set()
    return {name.casefold() for name in (manifest.model_id, *manifest.served_names)}


def describe_entry(cache: ModelCache, entry: EntryId, default: str | None) -> dict:
    path = cache.entry_path(entry)
    selected, leased = entry.version == default, cache.is_leased(entry)
    description: dict = {"version": entry.version, "selected": selected, "in_use": leased}
    try:
        manifest = fmt.read_package_files(path).primary.manifest
    except FlareError as error:
        description.update(error=str(error))
        return description
    plan = manifest.plan
    description.update(
        model_id=manifest.model_id, served_names=list(manifest.served_names),
        publisher=manifest.publisher.namespace, created=manifest.created,
        deployments=[{"name": d.name, "tensor_parallel": d.tensor_parallel,
                      "max_concurrency": plan.max_concurrency,
                      "decode_capacities": list(plan.decode_capacities),
                      "max_model_len": plan.max_model_len} for d in manifest.deployments])
    description.update(storage_figures(cache, path, manifest, selected, leased))
    return description


def storage_figures(cache: ModelCache, path: Path, manifest: Manifest, selected: bool, leased: bool) -> dict:
    unique = {record.sha256: record.size for record in manifest.payloads}
    inodes: dict[tuple[int, int], os.stat_result] = {}
    for file in path.rglob("*"):
        info = file.lstat()
        if file.is_file() and not file.is_symlink():
            inodes[(info.st_dev, info.st_ino)] = info
    blob_inodes = _blob_inodes(cache, unique)
    figures = {"logical_bytes": sum(unique.values()),
               "disk_logical_bytes": sum(i.st_size for i in inodes.values()),
               "disk_physical_bytes": sum(i.st_blocks * 512 for i in inodes.values()),
               "shared_logical_bytes": sum(i.st_size for i in inodes.values() if i.st_nlink > 1),
               "shared_physical_bytes": sum(i.st_blocks * 512 for i in inodes.values() if i.st_nlink > 1)}
    if selected or leased:
        why = "it is the selected default" if selected else "a running process leases it"
        figures.update(reclaimable_bytes=None, reclaimable_note=f"not reclaimable: {why}")
        return figures
    # An inode held only by this entry (and its blob, which gc then drops) is freed by removing the entry.
    figures["reclaimable_bytes"] = sum(
        info.st_blocks * 512 for key, info in inodes.items()
        if info.st_nlink == 1 or (info.st_nlink == 2 and key in blob_inodes))
    figures["reclaimable_note"] = "after `flare models remove` and `flare models gc`"
    return figures


def _blob_inodes(cache: ModelCache, hashes: dict[str, int]) -> set[tuple[int, int]]:
    found = set()
    for sha256 in hashes:
        try:
            info = cache.blob_path(sha256).stat()
        except FileNotFoundError:
            continue
        found.add((info.st_dev, info.st_ino))
    return found
