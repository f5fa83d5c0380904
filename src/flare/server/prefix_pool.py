"""The shared pool's manager (`flare prefix-pool`): several `flare run` servers of one package offer the
prefix states their host tiers hold and fetch those the others offered (spec §3.4, --prefix-cache-pool).

A Starlette app on uvicorn, on one Unix socket and at most one TCP listener (plain, or TLS with the
certificate and key given). Its memory is bounded: `--memory` bytes of pages in the store, the least
recently used given up first; a request body is read only up to `pool_wire.MAX_BODY_BYTES`, at most
BODIES_AT_ONCE of them at a time (the others wait unread), and an answer carries at most
`pool_wire.MAX_BATCH_BYTES` of pages (the rest answered as absent). The manager's `--name` salts the
scopes, so two pools' clients never share a page by accident. The hello (`GET /v1/pool`) declares what the
TCP listener speaks; Unix-socket clients trust the socket's file permissions (created 0600).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

import msgspec
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from flare.engine.retention.pool_address import PoolAddress, parse_pool_address
from flare.engine.retention.pool_wire import (MAX_BATCH_BYTES, MAX_BODY_BYTES, PageBatch, PageQuery, PoolHello,
                                              decode, encode, pool_salt)
from flare.errors import UsageError

MSGPACK = "application/msgpack"
BODIES_AT_ONCE = 8              # requests whose bodies are read and handled at one time


class PageStore:
    """Pages by (scope, key), at most `memory_bytes` of them, least recently used given up first."""

    def __init__(self, memory_bytes: int) -> None:
        self.memory_bytes = memory_bytes
        self.used_bytes = 0
        self._pages: OrderedDict[tuple[str, bytes], bytes] = OrderedDict()
        self._lock = threading.Lock()
        self.offered: dict[str, int] = {}               # instance -> pages it offered

    def get(self, scope: str, keys, limit_bytes: int = MAX_BATCH_BYTES) -> tuple[tuple[bytes, bytes | None], ...]:
        """The pages of `keys` (None where there is none), at most `limit_bytes` of them: the rest None."""
        with self._lock:
            found, size = [], 0
            for key in keys:
                payload = self._pages.get((scope, key))
                if payload is not None and size + len(payload) > limit_bytes:
                    payload = None
                if payload is not None:
                    self._pages.move_to_end((scope, key))
                    size += len(payload)
                found.append((key, payload))
            return tuple(found)

    def put(self, scope: str, pages, instance: str) -> None:
        with self._lock:
            for key, payload in pages:
                if payload is None or len(payload) > self.memory_bytes or (scope, key) in self._pages:
                    continue
                while self.used_bytes + len(payload) > self.memory_bytes:
                    _, dropped = self._pages.popitem(last=False)
                    self.used_bytes -= len(dropped)
                self._pages[(scope, key)] = payload
                self.used_bytes += len(payload)
                self.offered[instance] = self.offered.get(instance, 0) + 1

    def __len__(self) -> int:
        return len(self._pages)


@dataclass(frozen=True)
class PoolOptions:
    name: str
    memory_bytes: int
    listen: tuple[PoolAddress, ...]
    certificate: Path | None = None
    key: Path | None = None


def check_options(options: PoolOptions) -> None:
    """One Unix socket and one TCP listener at most; TLS needs a certificate and key, and only TLS takes them."""
    if not options.name.strip():
        raise UsageError("--name must not be blank: it salts the pool's scopes")
    if options.memory_bytes <= 0:
        raise UsageError("--memory must give the pool some room, such as 32G")
    kinds = [address.kind for address in options.listen]
    if not kinds:
        raise UsageError("give at least one --listen unix:PATH, HOST:PORT or tls:HOST:PORT")
    if kinds.count("unix") > 1 or sum(kind != "unix" for kind in kinds) > 1:
        raise UsageError("--listen takes one Unix socket and one TCP address (plain or tls:) at most")
    tls = "tls" in kinds
    if tls and (options.certificate is None or options.key is None):
        raise UsageError("--listen tls:HOST:PORT needs --certificate FILE and --key FILE")
    if not tls and (options.certificate is not None or options.key is not None):
        raise UsageError("--certificate and --key serve a tls:HOST:PORT listener; add one or drop them")


def pool_app(options: PoolOptions, store: PageStore) -> Starlette:
    encryption = "tls" if any(address.kind == "tls" for address in options.listen) else "none"
    hello = encode(PoolHello(options.name, pool_salt(options.name), encryption, options.memory_bytes))

    async def who(request: Request) -> Response:
        return Response(hello, media_type=MSGPACK)

    bodies = asyncio.Semaphore(BODIES_AT_ONCE)    # (made per app: uvicorn runs it on one event loop)

    async def get(request: Request) -> Response:
        async with bodies:
            query = decode(await _body(request), PageQuery)
            return Response(encode(PageBatch(query.scope, store.get(query.scope, query.keys))), media_type=MSGPACK)

    async def put(request: Request) -> Response:
        async with bodies:
            batch = decode(await _body(request), PageBatch)
            store.put(batch.scope, batch.pages, batch.instance)
            return Response(status_code=204)

    async def too_large(request: Request, error: Exception) -> Response:
        return Response(f"a request body carries at most {MAX_BODY_BYTES:,} bytes", status_code=413)

    async def malformed(request: Request, error: Exception) -> Response:
        return Response(f"not a pool message: {error}", status_code=400)

    return Starlette(routes=[Route("/v1/pool", who), Route("/v1/pool/get", get, methods=["POST"]),
                             Route("/v1/pool/put", put, methods=["POST"])],
                     exception_handlers={_TooLarge: too_large, msgspec.DecodeError: malformed,
                                         msgspec.ValidationError: malformed})


async def _body(request: Request) -> bytes:
    declared = int(request.headers.get("content-length") or 0)
    if declared > MAX_BODY_BYTES:
        raise _TooLarge()
    chunks, size = [], 0
    async for chunk in request.stream():
        size += len(chunk)
        if size > MAX_BODY_BYTES:
            raise _TooLarge()
        chunks.append(chunk)
    return b"".join(chunks)


class _TooLarge(Exception):
    pass


class _Listener(uvicorn.Server):
    """One listener of the manager; the manager, not each listener, takes the signals."""

    @contextlib.contextmanager
    def capture_signals(self):
        yield


def serve_pool(options: PoolOptions, ready: threading.Event | None = None,
               stop: threading.Event | None = None) -> PageStore:
    """Run the manager until SIGINT/SIGTERM (in the main thread) or `stop`; `ready` is set once it listens.
    Returns its store (what it held at the end)."""
    check_options(options)
    store = PageStore(options.memory_bytes)
    app = pool_app(options, store)
    listeners = [_Listener(uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                          **_where(address, options))) for address in options.listen]

    async def run() -> None:
        stopping = asyncio.Event()
        if threading.current_thread() is threading.main_thread():
            for sig in (signal.SIGINT, signal.SIGTERM):
                asyncio.get_running_loop().add_signal_handler(sig, stopping.set)
        tasks = [asyncio.create_task(listener.serve()) for listener in listeners]
        while not all(listener.started for listener in listeners) and not any(task.done() for task in tasks):
            await asyncio.sleep(0.01)
        for address in options.listen:
            if address.kind == "unix" and os.path.exists(address.path):
                os.chmod(address.path, 0o600)           # its clients trust the file's permissions
        if ready is not None:
            ready.set()
        while not stopping.is_set() and not (stop is not None and stop.is_set()) \
                and not any(task.done() for task in tasks):
            await asyncio.sleep(0.05)
        for listener in listeners:
            listener.should_exit = True
        await asyncio.gather(*tasks)

    asyncio.run(run())
    return store


def _where(address: PoolAddress, options: PoolOptions) -> dict:
    if address.kind == "unix":
        return {"uds": address.path}
    where = {"host": address.host, "port": address.port}
    if address.kind == "tls":
        where.update(ssl_certfile=str(options.certificate), ssl_keyfile=str(options.key))
    return where


def parse_listen(values) -> tuple[PoolAddress, ...]:
    return tuple(parse_pool_address(value, "--listen") for value in values)
