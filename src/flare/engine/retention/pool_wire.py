"""What the shared pool's manager and its clients say to each other: HTTP with msgpack bodies (one Struct
per exchange, one codec), shared by `pool_client.PoolClient` and `flare.server.prefix_pool`.

    GET  /v1/pool              -> PoolHello   the manager's name salt and what its TCP listener speaks
    POST /v1/pool/get  PageQuery   -> PageBatch   the pages of a scope it holds (None where it has none)
    POST /v1/pool/put  PageBatch   -> 204         pages offered into a scope

A scope is the SHA-256 of the manager's salt, the package identity and the KV layout: servers of one
package and cache format share one; anything else never meets. An instance identity (the salt with the
host and process) names which server offered a page, for the manager's counts.
"""

from __future__ import annotations

import hashlib

import msgspec

POOL_FORMAT = 1
MAX_BATCH_BYTES = 64 << 20          # a client's request or answer carries at most this much page data
MAX_BODY_BYTES = MAX_BATCH_BYTES + (1 << 20)    # what the manager reads of one request body


class PoolHello(msgspec.Struct, frozen=True):
    name: str
    salt: str                       # hex; scopes and instance identities are salted with it
    encryption: str                 # what the manager's TCP listener speaks: "tls" or "none"
    memory_bytes: int
    format: int = POOL_FORMAT


class PageQuery(msgspec.Struct, frozen=True):
    scope: str
    keys: tuple[bytes, ...]


class PageBatch(msgspec.Struct, frozen=True):
    scope: str
    pages: tuple[tuple[bytes, bytes | None], ...]      # (key, payload); None: the manager has no such page
    instance: str = ""


def pool_salt(name: str) -> str:
    return hashlib.sha256(f"flare prefix pool\0{name}".encode()).hexdigest()


def scope_of(salt: str, identity: str, layout: str) -> str:
    return hashlib.sha256(f"{salt}\0{identity}\0{layout}".encode()).hexdigest()


def instance_of(salt: str, host: str, pid: int) -> str:
    return hashlib.sha256(f"{salt}\0{host}\0{pid}".encode()).hexdigest()[:16]


encode = msgspec.msgpack.encode


def decode(data: bytes, kind: type):
    return msgspec.msgpack.decode(data, type=kind)
