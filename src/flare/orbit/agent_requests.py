"""What an agent does for each request beside running ranks: status, its cache's packages, a package's
envelope, logs, metrics, and storing a pushed package."""

from __future__ import annotations

import shutil
import socket
import time
from pathlib import Path
from typing import Any

from flare.errors import UsageError
from flare.hosts.distribution import check_space, free_bytes, plan_receipt, receive_payload
from flare.hosts.frames import Channel
from flare.hosts.messages import Envelope
from flare.orbit.messages import (CachedPackage, Described, Lacking, LogEnd, Logs, LogText, Needs, PackagesReply, PushPackage,
                                  Stored, StatusReply)
from flare.orbit.rank_processes import RankProcesses
from flare.package import format as fmt
from flare.package.store import EntryId, ModelCache

LOG_POLL_S = 0.2
RECEIVE_TIMEOUT_S = 60.0


def status(agent: Any) -> StatusReply:
    running = sum(state.state == "running" for state in agent.ranks.states())
    return StatusReply(socket.gethostname(), str(agent.cache_root), free_bytes(agent.cache_root), _devices(),
                       running, len(agent.state.controllers()))


def _devices() -> tuple[str, ...]:
    """The GPUs NVML reports, without starting CUDA; () where there are none."""
    try:
        import pynvml
    except ImportError:
        return ()
    try:
        pynvml.nvmlInit()
        names = tuple(str(pynvml.nvmlDeviceGetName(pynvml.nvmlDeviceGetHandleByIndex(index)))
                      for index in range(pynvml.nvmlDeviceGetCount()))
        pynvml.nvmlShutdown()
        return names
    except pynvml.NVMLError:
        return ()


def packages(cache_root: Path) -> PackagesReply:
    from flare.package.rank_copy import RANKS_DIR

    cache = ModelCache(cache_root)
    found = []
    for entry in cache.entries():
        found.append(_cached(cache.entry_path(entry), ()))
    copies: dict[Path, list[int]] = {}
    for primary in sorted((cache.root / RANKS_DIR).glob(f"*/*/rank-*/{fmt.PRIMARY_NAME}")):
        copies.setdefault(primary.parent.parent, []).append(int(primary.parent.name.split("-")[1]))
    for version_dir, ranks in copies.items():
        found.append(_cached(version_dir / f"rank-{ranks[0]}", tuple(sorted(ranks))))
    return PackagesReply(str(cache.root), tuple(found))


def _cached(path: Path, ranks: tuple[int, ...]) -> CachedPackage:
    manifest = fmt.read_package_files(path).manifest
    stored = sum(record.size for record in manifest.payloads if (path / record.name).exists())
    return CachedPackage(manifest.label, manifest.model_id, stored, ranks)


def describe(target: str, cache_root: Path) -> Described:
    from flare.package.reader import resolve_target

    path = resolve_target(target, cache_root)
    primary = fmt.read_package_files(path).primary
    return Described(str(Path(path).resolve()), Envelope(primary.manifest_body, primary.signature,
                                                         primary.profile_json))


def stream_logs(ranks: RankProcesses, request: Logs, channel: Channel) -> None:
    """Rank zero's log of `group` on this host (or the lowest rank here), then, with `follow`, what it
    writes until it ends."""
    states = sorted((s for s in ranks.states() if s.group == request.group), key=lambda s: s.rank)
    if not states:
        raise UsageError(f"no group {request.group} on {socket.gethostname()}")
    state = states[0]
    path = ranks.log_path(state.group, state.rank)
    with open(path, "rb") as log:
        while True:
            data = log.read(1 << 16)
            if data:
                channel.send(LogText(data.decode(errors="replace")))
                continue
            state = next(s for s in ranks.states() if s.group == state.group and s.rank == state.rank)
            if not request.follow or state.state != "running":
                rest = log.read()
                if rest:
                    channel.send(LogText(rest.decode(errors="replace")))
                channel.send(LogEnd(state.state, state.exit_code))
                return
            time.sleep(LOG_POLL_S)


def metrics(ranks: RankProcesses, group: str) -> str:
    """Rank zero's /metrics, read on this host from the listener it was started with."""
    import httpx

    listeners = [s.listener for s in ranks.states() if s.group == group and s.listener and s.state == "running"]
    if not listeners:
        raise UsageError(f"group {group} serves no HTTP listener from {socket.gethostname()}")
    try:
        response = httpx.get(f"{listeners[0]}/metrics", timeout=5.0)
    except httpx.HTTPError as error:
        raise UsageError(f"rank zero of {group} does not answer at {listeners[0]} yet ({type(error).__name__})") from None
    return response.text


def _signed_records(envelope: Envelope, names: tuple[str, ...]):
    from flare.package.trust import TrustOptions, verify_signature

    primary = fmt.Primary(envelope.manifest_body, envelope.signature, envelope.profile_json, "directory")
    verify_signature(primary.manifest_body, primary.signature, primary.manifest, primary.profile_json,
                     TrustOptions(require_acceptance=False), "the pushed package")
    wanted = set(names)
    return primary, tuple(record for record in primary.manifest.payloads if record.name in wanted)


def lacking(request: Lacking, cache_root: Path) -> Needs:
    _, records = _signed_records(request.envelope, request.payloads)
    cache = ModelCache(cache_root)
    receipt = plan_receipt(cache, records)
    check_space(cache, receipt, max(request.rank, 0))
    return Needs(tuple(record.name for record in receipt.fetched))


def receive_push(request: PushPackage, cache_root: Path, channel: Channel) -> Stored:
    """A pushed package (one rank's payloads, or all of them) into this host's cache, verified as it arrives."""
    from flare.package.rank_copy import RankCopies
    from flare.package.reader import verify_stored_data

    primary, records = _signed_records(request.envelope, request.payloads)
    wanted = set(request.payloads)
    cache = ModelCache(cache_root)
    cache.ensure()
    receipt = plan_receipt(cache, records)
    check_space(cache, receipt, max(request.rank, 0))
    channel.send(Needs(tuple(record.name for record in receipt.fetched)))
    source = f"the controller at {channel.peer}"
    with cache.staging_tree() as staging:
        tree = staging / "entry"
        tree.mkdir()
        for record in receipt.fetched:
            receive_payload(lambda: channel.receive(timeout=RECEIVE_TIMEOUT_S), record, tree / ".incoming", cache,
                            source)
        if not request.publish:
            return Stored("", receipt.fetch_bytes)
        for record in records:
            cache.link_blob(record.sha256, tree / record.name)
        shutil.rmtree(tree / ".incoming", ignore_errors=True)
        if request.rank >= 0:
            path = RankCopies(cache).publish(tree, primary, request.rank)
        else:
            path = _publish_entry(cache, tree, primary)
    files = fmt.read_package_files(path)
    verify_stored_data(files, payloads=tuple(r for r in files.manifest.payloads if r.name in wanted))
    return Stored(str(path), receipt.fetch_bytes)


def _publish_entry(cache: ModelCache, tree: Path, primary: fmt.Primary) -> Path:
    entry = EntryId(primary.manifest.model_key, primary.manifest.version)
    existing = cache.entry_path(entry)
    if existing.is_dir():
        if fmt.read_package_files(existing).primary.manifest_body != primary.manifest_body:
            raise UsageError(f"{cache.root} holds another {entry}; remove it there with `flare models remove` first")
        return existing
    fmt.write_primary(tree / fmt.PRIMARY_NAME, primary)
    return cache.publish(tree, entry, select=True)
