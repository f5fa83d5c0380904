"""A peer's part of the bootstrap: verify rank zero's package here, store this rank's payloads, verify them.

The peer trusts nothing rank zero says but what the package's signature proves: the envelope is
verified with this host's keys and trust store (and this peer's trust flags), the publisher accepted
here, every received payload hashed against the signed manifest, and the finished copy checked as
every load checks a package. A local package, when the peer was given one, must be exactly the export
rank zero serves; an earlier copy of this rank is reused; otherwise the payloads the cache lacks are
fetched, after checking that they fit.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from flare.errors import UsageError
from flare.hosts import distribution
from flare.hosts.messages import Offer, Staged
from flare.package import format as fmt
from flare.package.rank_copy import RankCopies, deployment_named, rank_payloads
from flare.package.store import ModelCache


def stage_rank(options: Any, offer: Offer, source: str, stages: Any) -> tuple[Any, Staged]:
    """(the verified Package this rank serves, what staging moved)."""
    from flare.package.trust import authorize, verify_signature

    envelope = offer.envelope
    primary = fmt.Primary(envelope.manifest_body, envelope.signature, envelope.profile_json, "directory")
    manifest = primary.manifest
    with stages.stage("Verify package") as stage:
        key, key_source = verify_signature(primary.manifest_body, primary.signature, manifest,
                                           primary.profile_json, options.trust, f"the package rank zero serves")
        records = rank_payloads(manifest, deployment_named(manifest, offer.deployment), offer.rank)
        stage.note(f"{manifest.model_id} {manifest.version}, signed by {manifest.publisher.namespace}")
    with stages.stage("Publisher acceptance", animate=False) as stage:
        trust = authorize(manifest, key, key_source, options.trust)
        stage.note(f"{trust.namespace} ({trust.identity})")
    cache = ModelCache(options.cache_root)
    path, staged = _local_copy(options, primary, offer, cache)
    if path is None:
        path, staged = _receive(options, primary, offer, records, cache, source, stages)
    with stages.stage("Verify stored data") as stage:
        package = _verified(path, records, trust, options.trust.verify_weights)
        stage.note(f"rank {offer.rank}: {len(records)} payloads at {path}")
    return package, staged


def _local_copy(options: Any, primary: fmt.Primary, offer: Offer, cache: ModelCache):
    """A package given on the command line (it must be rank zero's), or an earlier copy of this rank."""
    if options.package is not None:
        from flare.package.reader import resolve_target

        path = resolve_target(options.package, cache.root)
        local = fmt.read_package_files(path).primary
        if local.manifest_body != primary.manifest_body:
            raise UsageError(f"{path} is {local.manifest.label}, but rank zero serves {primary.manifest.label}: a "
                             "peer's own package must be the very export rank zero serves. Drop PACKAGE to receive "
                             "rank zero's, or give the same export to every rank")
        return path, Staged(0, 0)
    existing = RankCopies(cache).find(primary, offer.rank)
    return (existing, Staged(0, 0)) if existing is not None else (None, None)


def _receive(options: Any, primary: fmt.Primary, offer: Offer, records, cache: ModelCache, source: str, stages):
    receipt = distribution.plan_receipt(cache, records)
    distribution.check_space(cache, receipt, offer.rank)
    with stages.stage("Receive payloads", total=receipt.fetch_bytes or None) as stage:
        with cache.staging_tree() as staging:
            tree = staging / "entry"
            tree.mkdir()
            distribution.receive(options.rendezvous, offer.session, offer.rank, receipt, offer.streams, tree,
                                 cache, source)
            path = RankCopies(cache).publish(tree, primary, offer.rank)
        stage.note(f"{len(receipt.fetched)} payloads ({receipt.fetch_bytes:,} bytes) over up to {offer.streams} "
                   f"streams; {len(receipt.held)} already cached")
    return path, Staged(receipt.fetch_bytes, receipt.held_bytes)


def _verified(path: Path, records, trust, full_hash: bool):
    from flare.package.reader import Package, verify_stored_data

    files = fmt.read_package_files(path)
    frontend, catalogs, checked = verify_stored_data(files, full_hash, payloads=records)
    return Package(path, files, files.primary.manifest, trust, frontend, catalogs, checked)
