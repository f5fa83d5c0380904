"""The shared pool's address grammar and CA rule (spec §3.4), for `flare run --prefix-cache-pool` and the
`flare prefix-pool` manager alike.

    unix:PATH          a local socket; its clients trust the file system's permissions
    HOST:PORT          plain TCP
    tls:HOST:PORT      TLS (Python's ssl); the manager's certificate is checked against
                       --prefix-cache-pool-ca FILE, or the host's trust store without one

A network address needs a nonempty host and a port from 1 through 65535; an IPv6 host is written in
brackets ([::1]:7000, tls:[::1]:7000). A CA goes with a TLS address only, and only beside the pool flag.
"""

from __future__ import annotations

import ssl
from dataclasses import dataclass
from pathlib import Path

from flare.errors import UsageError


@dataclass(frozen=True)
class PoolAddress:
    kind: str                       # "unix", "tcp" or "tls"
    path: str | None = None         # unix
    host: str | None = None         # tcp, tls (IPv6 without its brackets)
    port: int | None = None

    @property
    def encrypted(self) -> bool:
        return self.kind == "tls"

    def url(self) -> str:
        """The base URL an HTTP client speaks to (a unix socket's is a placeholder host)."""
        if self.kind == "unix":
            return "http://pool"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'https' if self.kind == 'tls' else 'http'}://{host}:{self.port}"

    def __str__(self) -> str:
        if self.kind == "unix":
            return f"unix:{self.path}"
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"{'tls:' if self.kind == 'tls' else ''}{host}:{self.port}"


def parse_pool_address(text: str, flag: str = "--prefix-cache-pool") -> PoolAddress:
    """The address `text`, or a UsageError naming `flag` and what to write."""
    example = "write unix:PATH, HOST:PORT or tls:HOST:PORT, e.g. unix:/run/flare/pool.sock or tls:[::1]:7000"
    if text.startswith("unix:"):
        path = text[len("unix:"):]
        if not path:
            raise UsageError(f"{flag} {text!r} names no socket path; {example}")
        return PoolAddress("unix", path=path)
    kind, rest = ("tls", text[len("tls:"):]) if text.startswith("tls:") else ("tcp", text)
    if rest.startswith("["):
        host, bracket, after = rest[1:].partition("]")
        if not bracket or not after.startswith(":") or ":" not in host:
            raise UsageError(f"{flag} {text!r}: an IPv6 host goes in brackets before the port, as [::1]:7000")
        port_text = after[1:]
    else:
        host, colon, port_text = rest.rpartition(":")
        if not colon:
            raise UsageError(f"{flag} {text!r} has no port; {example}")
        if ":" in host:
            raise UsageError(f"{flag} {text!r}: an IPv6 host goes in brackets, as [{host}]:{port_text}")
    if not host:
        raise UsageError(f"{flag} {text!r} has an empty host; {example}")
    if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
        raise UsageError(f"{flag} {text!r}: the port must be a number from 1 through 65535")
    return PoolAddress(kind, host=host, port=int(port_text))


def check_pool_ca(address: PoolAddress | None, ca_file: Path | None) -> None:
    """The CA rule: only beside the pool flag, only for a TLS address, and a file Python's ssl can load."""
    if ca_file is None:
        return
    if address is None:
        raise UsageError("--prefix-cache-pool-ca is the CA of a TLS pool manager; it needs --prefix-cache-pool "
                         "tls:HOST:PORT")
    if not address.encrypted:
        raise UsageError(f"--prefix-cache-pool-ca cannot be used with --prefix-cache-pool {address}: only a "
                         "tls:HOST:PORT address checks a CA (a Unix socket trusts file permissions, plain TCP "
                         "nothing); drop the CA or use tls:")
    try:
        ssl.create_default_context(cafile=str(ca_file))
    except (OSError, ssl.SSLError) as error:
        raise UsageError(f"--prefix-cache-pool-ca {ca_file}: not a CA file Python's ssl can load ({error})") from None
