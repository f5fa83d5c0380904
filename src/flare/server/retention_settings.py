"""`flare run`'s prefix retention: [prefix_cache], [paths] prefix_cache and --prefix-cache-pool, checked
and resolved into the engine's `RetentionSettings` before anything loads, and said in the start-up report.

* `[prefix_cache] memory` turns the host tier on (pinned host memory on a GPU; on a CPU it shares the host
  memory the KV pool is sized from). Every tier below passes through it, so the disk tier and the pool
  need it.
* `[paths] prefix_cache` turns the disk tier on: page files under the package's own folder there, within
  `disk_limit` (default: 10% of the file system's free space, counting what the folder holds already),
  read and written `staged` (through the OS page cache) or `direct` (O_DIRECT, checked to work there).
  `drain_on_shutdown` lets a clean stop write the host tier down; the disk keys need the disk tier.
* `--prefix-cache-pool ADDRESS` (and its CA) shares retained states with the other servers of this
  package through a `flare prefix-pool` manager.
"""

from __future__ import annotations

import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from flare.engine.retention.pool_address import check_pool_ca, parse_pool_address
from flare.engine.retention.settings import DiskRetention, PoolRetention, RetentionSettings
from flare.errors import CapacityError, UsageError
from flare.memory import GiB, read_host_memory

DEFAULT_DISK_SHARE = 0.10           # disk_limit's default: this share of the free space
HOST_MEMORY_KEPT = 0.10             # of the host's available memory, left to everything else


@dataclass(frozen=True)
class PoolFlags:
    address: str | None = None      # --prefix-cache-pool
    ca_file: Path | None = None     # --prefix-cache-pool-ca


def check_pool_flags(flags: PoolFlags) -> None:
    """The pool flags' grammar and CA rule, before anything loads."""
    address = parse_pool_address(flags.address) if flags.address is not None else None
    check_pool_ca(address, flags.ca_file)


def serving_retention(config: Any, identity: str, pool: PoolFlags = PoolFlags()) -> RetentionSettings:
    """The engine's RetentionSettings for serving the package of `identity`."""
    check_pool_flags(pool)
    section = config.prefix_cache if config is not None else None
    directory = config.paths.prefix_cache if config is not None else None
    where = f" in {config.path}" if config is not None else ""
    memory = (section.memory or 0) if section is not None else 0
    _check_disk_keys(section, directory, where)
    if not memory:
        if directory is not None:
            raise UsageError(f"[paths] prefix_cache{where} keeps retained prefix states on disk, and they pass "
                             "through host memory: set [prefix_cache] memory as well (e.g. memory = \"16G\"), "
                             "or remove prefix_cache")
        if pool.address is not None:
            raise UsageError("--prefix-cache-pool shares retained prefix states, and they pass through host "
                             f"memory: set [prefix_cache] memory{where} (e.g. memory = \"16G\"), or drop the flag")
        return RetentionSettings()
    _check_host_memory(memory, where)
    disk = _disk(section, Path(directory), where) if directory is not None else None
    shared = PoolRetention(pool.address, str(pool.ca_file) if pool.ca_file else None) if pool.address else None
    return RetentionSettings(host_bytes=memory, identity=identity, disk=disk, pool=shared)


def retention_lines(settings: RetentionSettings, stats=None) -> list[str]:
    """The start-up report's account of where retained prefix states live and how much they hold; `stats`
    (the engine's EngineStats at start) adds the host tier's pages and what the disk kept from earlier runs."""
    from flare.ui.progress import format_bytes

    if not settings.enabled:
        return ["  prefix cache: GPU pages only ([prefix_cache] memory keeps evicted prefixes in host memory)"]
    slots = stats.retained_host_slots if stats is not None else 0
    lines = [f"  prefix cache: GPU pages, then {format_bytes(settings.host_bytes)} of host memory"
             + (f" ({slots:,} pages)" if slots else "")]
    disk = settings.disk
    if disk is not None:
        drain = f"; a clean stop writes the host tier down for up to {disk.drain_s:g} s" if disk.drain_s else ""
        lines.append(f"    then disk: up to {format_bytes(disk.limit_bytes)} under {disk.directory} "
                     f"({disk.transport}){drain}")
        if stats is not None:
            lines.append(f"    the disk holds {stats.retained_disk_pages:,} pages "
                         f"({format_bytes(stats.retained_disk_bytes)}) from earlier runs" if stats.retained_disk_pages
                         else "    the disk holds no pages of this package yet")
    if settings.pool is not None:
        lines.append(f"    shared with other servers through the pool at {settings.pool.address}")
    return lines


# ---- internals ---------------------------------------------------------------------------------------

def _check_disk_keys(section, directory, where: str) -> None:
    if section is None or directory is not None:
        return
    for key, value in (("disk_limit", section.disk_limit), ("disk_transport", section.disk_transport),
                       ("drain_on_shutdown", section.drain_on_shutdown or None)):
        if value is not None:
            raise UsageError(f"[prefix_cache] {key}{where} sets the disk tier, which [paths] prefix_cache turns on: "
                             f"set prefix_cache to a directory, or remove {key}")


def _check_host_memory(memory: int, where: str) -> None:
    available = read_host_memory().free
    usable = int(available * (1 - HOST_MEMORY_KEPT))
    if memory > usable:
        fits = max(0, usable // GiB)
        raise CapacityError(f"[prefix_cache] memory{where} needs {memory / GiB:.1f} GiB of host memory; has "
                            f"{available / GiB:.1f} GiB available − {HOST_MEMORY_KEPT:.0%} kept for the rest of "
                            f"the host = {usable / GiB:.1f} GiB.\n       Options: [prefix_cache] memory = "
                            f"\"{fits}G\".")


def _disk(section, directory: Path, where: str) -> DiskRetention:
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError as error:
        raise UsageError(f"[paths] prefix_cache{where}: cannot create {directory} ({error.strerror}); "
                         "choose a directory this user can write") from None
    transport = section.disk_transport or "staged"
    if transport == "direct":
        from flare.engine.retention.disk_store import check_direct_io

        refused = check_direct_io(directory)
        if refused:
            raise UsageError(f"[prefix_cache] disk_transport = \"direct\"{where}: {refused} under {directory}; "
                             "use disk_transport = \"staged\" or another [paths] prefix_cache")
    limit = section.disk_limit
    if limit is None:
        held = sum(path.stat().st_size for path in directory.rglob("*.kv"))
        limit = int((shutil.disk_usage(directory).free + held) * DEFAULT_DISK_SHARE)
    return DiskRetention(str(directory), limit, transport, section.drain_on_shutdown or 0.0)
