"""Where prefix states go when they leave the GPU: frozen, part of `flare.engine.config.EngineConfig`.

`flare run` builds these from `[prefix_cache]`, `[paths] prefix_cache` and `--prefix-cache-pool`
(flare.server.retention_settings); an engine built without them keeps cached prefixes in GPU pages only.
The host tier is the one every lower tier passes through: disk and pool need `host_bytes`.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass

DISK_TRANSPORTS = ("staged", "direct")


@dataclass(frozen=True)
class DiskRetention:
    """The disk tier: page files under `directory` (one folder per package identity and KV layout)."""

    directory: str                          # [paths] prefix_cache
    limit_bytes: int                        # disk_limit, resolved at start-up (default: 10% of free space)
    transport: str = "staged"               # staged: through the OS page cache; direct: O_DIRECT
    drain_s: float = 0.0                    # drain_on_shutdown: seconds a clean stop may write (0: off)


@dataclass(frozen=True)
class PoolRetention:
    """The shared pool: a `flare prefix-pool` manager several servers of one model use."""

    address: str                            # unix:PATH | HOST:PORT | tls:HOST:PORT, checked already
    ca_file: str | None = None              # --prefix-cache-pool-ca (tls only)


@dataclass(frozen=True)
class RetentionSettings:
    host_bytes: int = 0                     # [prefix_cache] memory; 0: nothing leaves the GPU
    # The served package's identity (SHA-256 of its signed manifest): disk files and pool entries are kept
    # under it, so another model or version never reads them. "" without a package (no disk, no pool).
    identity: str = ""
    disk: DiskRetention | None = None
    pool: PoolRetention | None = None

    def __post_init__(self) -> None:
        if self.host_bytes < 0:
            raise ValueError(f"host_bytes must not be negative, not {self.host_bytes}")
        if (self.disk is not None or self.pool is not None) and not self.host_bytes:
            raise ValueError("disk and pool retention pass through the host tier: give host_bytes")
        if (self.disk is not None or self.pool is not None) and not self.identity:
            raise ValueError("disk and pool retention keep states under a package identity: give identity")
        if self.disk is not None and self.disk.transport not in DISK_TRANSPORTS:
            raise ValueError(f"disk transport {self.disk.transport!r}: choose one of {', '.join(DISK_TRANSPORTS)}")

    @property
    def enabled(self) -> bool:
        return self.host_bytes > 0

    @property
    def stores_below_host(self) -> bool:
        """Whether host slots are written further down (disk or pool)."""
        return self.disk is not None or self.pool is not None


def package_identity(manifest_body: str) -> str:
    """The identity retained states are kept under: the SHA-256 of the package's signed manifest text."""
    return hashlib.sha256(manifest_body.encode()).hexdigest()
