"""Install a package from outside the cache (a downloaded packed file or directory) as a cache entry.

The entry keeps the package's signed version and exact primary; every payload is hashed while it is
copied into staging and then shares its blob with any entry that already holds the same bytes.
Installing a version the cache already has returns the existing entry when its signed body matches.
"""

from __future__ import annotations

from pathlib import Path
from typing import Iterable

from flare.errors import PreparationError
from flare.package import format as fmt
from flare.package.manifest import PayloadRecord
from flare.package.store import EntryId, ModelCache
from flare.package.trust import TrustOptions, verify_signature
from flare.package.verify import check_layout, copy_payload


def install_package(source: Path, cache: ModelCache, trust: TrustOptions | None = None,
                    select: bool = True) -> Path:
    """Verify `source` (signature and every payload hash) and publish it in `cache`; return the entry."""
    files = fmt.read_package_files(Path(source))
    manifest = files.primary.manifest
    verify_signature(files.primary.manifest_body, files.primary.signature, manifest, files.primary.profile_json,
                     trust or TrustOptions(require_acceptance=False), str(files.primary_path))
    check_layout(files, manifest.payloads)
    entry = EntryId(manifest.model_key, manifest.version)
    existing = cache.entry_path(entry)
    if existing.is_dir():
        if fmt.read_package_files(existing).primary.manifest_body != files.primary.manifest_body:
            raise PreparationError(f"the cache already holds a different {entry}; remove it with "
                                   "`flare models remove` before installing this one")
        if select:
            cache.select(entry)
        return existing
    with cache.staging_tree() as staging:
        tree = staging / "entry"
        tree.mkdir()
        stage_payloads(cache, files, manifest.payloads, tree, "nothing was installed")
        fmt.write_primary(tree / fmt.PRIMARY_NAME, files.primary)
        return cache.publish(tree, entry, select=select)


def stage_payloads(cache: ModelCache, files: fmt.PackageFiles, records: Iterable[PayloadRecord], tree: Path,
                   consequence: str) -> None:
    """Lay every payload of `records` out under `tree` by its name, as a hard link to its blob.

    A payload the cache already holds is linked without reading it; any other is copied out of `files`
    (checked against its signed size and SHA-256 on the way) and stored as a new blob. A mismatch raises
    an IntegrityError ending with `consequence`."""
    for record in records:
        staged = tree / record.name
        staged.parent.mkdir(parents=True, exist_ok=True)
        if cache.has_blob(record.sha256):
            cache.link_blob(record.sha256, staged)
            continue
        copy_payload(files, record, staged, consequence)
        cache.store_payload(staged, record.sha256)
