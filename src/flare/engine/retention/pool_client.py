"""The shared pool's client (runner side): offers host slots' pages to a `flare prefix-pool` manager and
fetches pages other servers of the same package offered, over httpx (a Unix socket, plain TCP, or TLS
checked against --prefix-cache-pool-ca or the host's trust store).

The pool is best effort. The first exchange asks the manager who it is (`PoolHello`). A manager that
answers in another format, declares another encryption than the address's, or speaks another protocol on
the wire (a TCP client reaching a TLS manager in plain text, TLS at a plain one, a certificate the CA does
not sign) turns the pool off for this server with a note: that is a setting to change. A manager that is
not there (yet, or any more: refused, no socket, no answer in time) pauses the pool instead, and it is
asked again after RETRY_S, so a pool started after its servers, or restarted, is found again. A busy
manager (503) costs only that exchange. Serving goes on with the local tiers throughout. A page of the
wrong size is treated as absent.

Without --prefix-cache-pool-ca a TLS manager is checked against the host's trust store (Python's
`ssl.create_default_context()`), not a bundle of httpx's own.
"""

from __future__ import annotations

import os
import socket
import ssl
import threading
import time
from collections.abc import Callable

import httpx
import msgspec

from flare.engine.retention.pool_address import parse_pool_address
from flare.engine.retention.pool_wire import (MAX_BATCH_BYTES, POOL_FORMAT, PageBatch, PageQuery, PoolHello, decode,
                                              encode, instance_of, scope_of)
from flare.engine.retention.settings import PoolRetention

TIMEOUT_S = 10.0
RETRY_S = 30.0                  # a manager that did not answer is asked again after this long


class PoolClient:
    def __init__(self, settings: PoolRetention, identity: str, layout: str, page_bytes: int,
                 note: Callable[[str], None]) -> None:
        self.address = parse_pool_address(settings.address)
        self.identity, self.layout, self.page_bytes, self.note = identity, layout, page_bytes, note
        verify: ssl.SSLContext | bool = False
        if self.address.encrypted:                 # the CA given, else the host's trust store
            verify = ssl.create_default_context(cafile=settings.ca_file)
        transport = (httpx.HTTPTransport(uds=self.address.path, verify=verify) if self.address.kind == "unix"
                     else httpx.HTTPTransport(verify=verify))
        self._http = httpx.Client(base_url=self.address.url(), transport=transport, timeout=TIMEOUT_S)
        self._lock = threading.Lock()
        self._scope: str | None = None
        self._instance = ""
        self.disabled: str | None = None          # why the pool is off for this server (for good)
        self._paused_until = 0.0                  # monotonic time: not asked before (a manager not there)
        self._paused = False                      # said so, and not answered since
        self._shared = False                      # a manager answered once

    def put(self, pages: list[tuple[bytes, list[memoryview]]]) -> None:
        """Offer pages (key, one block per cache tensor) to the pool; failures are noted, never raised."""
        scope = self._connected()
        if scope is None:
            return
        for batch in _batches(pages, self.page_bytes):
            body = PageBatch(scope, tuple((key, b"".join(parts)) for key, parts in batch), self._instance)
            if self._send("/v1/pool/put", encode(body)) is None and self._scope is None:
                return                                  # paused: the rest waits for the next offer

    def get(self, pages: list[tuple[bytes, list[memoryview]]]) -> set[bytes]:
        """Fill the pages the pool holds (key, the blocks to fill); returns the keys it filled."""
        scope = self._connected()
        found: set[bytes] = set()
        if scope is None:
            return found
        for batch in _batches(pages, self.page_bytes):
            targets = dict(batch)
            answer = self._send("/v1/pool/get", encode(PageQuery(scope, tuple(targets))))
            if answer is None:
                break
            try:
                pages_found = decode(answer, PageBatch).pages
            except (msgspec.DecodeError, msgspec.ValidationError) as error:
                with self._lock:
                    self._pause(f"the manager's answer is not a page batch ({error})")
                break
            for key, payload in pages_found:
                if payload is None or len(payload) != self.page_bytes or key not in targets:
                    continue
                offset = 0
                for part in targets[key]:
                    part[:] = payload[offset:offset + len(part)]
                    offset += len(part)
                found.add(key)
        return found

    def close(self) -> None:
        self._http.close()

    # ---- internals -------------------------------------------------------------------------------

    def _connected(self) -> str | None:
        """The scope, after the manager said who it is; None while the pool is off or paused."""
        with self._lock:
            if self._scope is None and self.disabled is None and time.monotonic() >= self._paused_until:
                self._hello()
            return self._scope

    def _hello(self) -> None:
        try:
            response = self._http.get("/v1/pool")
            response.raise_for_status()
            hello = decode(response.content, PoolHello)
        except (httpx.ConnectError, httpx.TimeoutException) as error:
            if _tls_failure(error):
                self._disable(f"no pool manager answered ({type(error).__name__}: {error})" + self._hint())
            else:
                self._pause(f"no pool manager answers ({type(error).__name__}: {error})")
            return
        except Exception as error:                  # another protocol or format on the wire: a setting
            self._disable(f"no pool manager answered ({type(error).__name__}: {error})" + self._hint())
            return
        if hello.format != POOL_FORMAT:
            self._disable(f"the manager speaks pool format {hello.format}, this server {POOL_FORMAT}")
            return
        declared = hello.encryption == "tls"
        if self.address.kind != "unix" and declared != self.address.encrypted:
            self._disable(f"the manager declares {'TLS' if declared else 'no encryption'} for TCP, but "
                          f"{self.address} {'uses TLS' if self.address.encrypted else 'is plain TCP'}; "
                          f"use {'tls:' if declared else 'a plain'} address")
            return
        self._scope = scope_of(hello.salt, self.identity, self.layout)
        self._instance = instance_of(hello.salt, socket.gethostname(), os.getpid())
        self.note(f"sharing retained states through the pool {hello.name!r} at {self.address}"
                  + (" again" if self._shared else ""))
        self._paused, self._shared = False, True

    def _send(self, path: str, body: bytes) -> bytes | None:
        try:
            response = self._http.post(path, content=body, headers={"content-type": "application/msgpack"})
        except Exception as error:
            with self._lock:
                self._pause(f"the manager stopped answering ({type(error).__name__}: {error})")
            return None
        if response.status_code == 503:             # busy: this exchange is skipped
            return None
        if response.is_error:
            with self._lock:
                self._pause(f"the manager answered {response.status_code} ({response.text[:200]})")
            return None
        return response.content

    def _pause(self, why: str) -> None:
        """Not asked again for RETRY_S; said once until the manager answers again."""
        self._scope = None
        self._paused_until = time.monotonic() + RETRY_S
        if not self._paused:
            self._paused = True
            self.note(f"the shared pool at {self.address} is paused for this server: {why}; asked again every "
                      f"{RETRY_S:g} s, the host and disk tiers go on meanwhile")

    def _disable(self, why: str) -> None:
        if self.disabled is None:
            self.disabled = why
            self._scope = None
            self.note(f"the shared pool at {self.address} is off for this server: {why}; the host and disk "
                      "tiers go on alone")

    def _hint(self) -> str:
        if self.address.kind == "tcp":
            return " (a TLS manager needs a tls: address)"
        if self.address.kind == "tls":
            return " (a plain-TCP manager needs an address without tls:; a private CA needs --prefix-cache-pool-ca)"
        return ""


def _tls_failure(error: BaseException) -> bool:
    """Whether a connection failed in its TLS handshake (a certificate, or TLS at a plain listener)."""
    while error is not None:
        if isinstance(error, ssl.SSLError):
            return True
        error = error.__cause__ or error.__context__
    return False


def _batches(pages: list, page_bytes: int) -> list[list]:
    per_batch = max(1, MAX_BATCH_BYTES // max(1, page_bytes))
    return [pages[start:start + per_batch] for start in range(0, len(pages), per_batch)]
