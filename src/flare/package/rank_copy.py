"""One rank's share of a multi-host package, and the copy of it a peer keeps in its cache.

    rank_payloads(manifest, deployment, rank)    the payloads that rank loads
    RankCopies(cache).path(manifest, rank)       <cache>/ranks/<model-key>/<version>/rank-<n>/
    RankCopies(cache).publish(tree, manifest, rank)
    open_rank_copy(path, rank, trust)            verified as a package is, over that rank's payloads only

A rank copy is the package's signed primary and the payloads one rank loads: the deployment's files
for that rank, the frontend, and the weight payloads no rank owns alone (shared by every rank). Its
payload files are hard links to the cache's blobs, as an entry's are, so copies of several ranks or
versions share bytes, and `flare models gc` keeps every blob a copy links. Copies live beside
`models/`, not in it: they are not complete packages, so `flare models list` and `flare run MODEL`
never take one for an entry. A copy is published like an entry, by one rename of a finished tree.
"""

from __future__ import annotations

import os
from pathlib import Path

from flare.errors import UsageError
from flare.package import format as fmt
from flare.package.manifest import Deployment, Manifest, PayloadRecord
from flare.package.store import ModelCache

RANKS_DIR = "ranks"


def deployment_named(manifest: Manifest, name: str) -> Deployment:
    for deployment in manifest.deployments:
        if deployment.name == name:
            return deployment
    raise UsageError(f"{manifest.label} has no deployment {name!r}; it has "
                     f"{', '.join(d.name for d in manifest.deployments)}")


def multi_rank_deployment(manifest: Manifest) -> Deployment:
    """The deployment a multi-host launch serves: the package's one deployment of more than one rank."""
    several = [d for d in manifest.deployments if d.tensor_parallel > 1]
    if not several:
        raise UsageError(f"{manifest.label} holds one rank (tensor parallel 1); serving across hosts takes a "
                         "package of several ranks. Serve it with `flare run PACKAGE`, without --rank")
    if len(several) > 1:
        raise UsageError(f"{manifest.label} holds several multi-rank deployments "
                         f"({', '.join(d.name for d in several)}); a launch across hosts serves a package of one")
    return several[0]


def rank_payloads(manifest: Manifest, deployment: Deployment, rank: int) -> tuple[PayloadRecord, ...]:
    """What `rank` of `deployment` loads, in manifest order: its own files, the frontend, and the weight
    payloads that no rank of the deployment names (shared by all)."""
    if not 0 <= rank < deployment.tensor_parallel:
        raise UsageError(f"rank {rank} is outside {manifest.label}'s ranks 0-{deployment.tensor_parallel - 1}")
    owned = {name for record in deployment.ranks for name in record.payloads}
    mine = {name for record in deployment.ranks if record.rank == rank for name in record.payloads}
    return tuple(record for record in manifest.payloads
                 if record.name in mine or record.kind == "frontend"
                 or (record.kind == "weights" and record.name not in owned))


class RankCopies:
    """The rank copies of one cache root."""

    def __init__(self, cache: ModelCache) -> None:
        self.cache = cache

    @property
    def root(self) -> Path:
        return self.cache.root / RANKS_DIR

    def path(self, manifest: Manifest, rank: int) -> Path:
        return self.root / manifest.model_key / manifest.version / f"rank-{rank}"

    def find(self, primary: fmt.Primary, rank: int) -> Path | None:
        """An existing copy of exactly this signed package and rank, or None."""
        path = self.path(primary.manifest, rank)
        if not (path / fmt.PRIMARY_NAME).is_file():
            return None
        if fmt.read_package_files(path).primary.manifest_body != primary.manifest_body:
            raise UsageError(f"{path} holds another package signed as {primary.manifest.label}; remove that "
                             "directory and launch again")
        return path

    def publish(self, tree: Path, primary: fmt.Primary, rank: int) -> Path:
        """Write the primary into a finished tree of payload links and rename it into place."""
        fmt.write_primary(tree / fmt.PRIMARY_NAME, primary)
        destination = self.path(primary.manifest, rank)
        with self.cache.lock(f"model-{primary.manifest.model_key}"):
            existing = self.find(primary, rank)
            if existing is not None:
                return existing
            destination.parent.mkdir(parents=True, exist_ok=True)
            os.rename(tree, destination)
        return destination


def open_rank_copy(path: Path, rank: int, deployment: str, trust, stream=None):
    """A rank copy (or a whole package) verified for serving `rank`: signature, publisher acceptance,
    and the stored-data checks of every load over the payloads that rank loads."""
    from flare.package.reader import Package, verify_stored_data
    from flare.package.trust import authorize, verify_signature

    files = fmt.read_package_files(path)
    primary, manifest = files.primary, files.primary.manifest
    key, source = verify_signature(primary.manifest_body, primary.signature, manifest, primary.profile_json,
                                   trust, str(files.primary_path))
    result = authorize(manifest, key, source, trust, stream)
    records = rank_payloads(manifest, deployment_named(manifest, deployment), rank)
    frontend, catalogs, checked = verify_stored_data(files, trust.verify_weights, payloads=records)
    return Package(path, files, manifest, result, frontend, catalogs, checked)
