"""HOST:PORT as the multi-host flags write it (`--rendezvous`, `--listen`, `ignition join`, orbit nodes).

    parse_address("10.0.0.5:29800", "--rendezvous")   -> Address("10.0.0.5", 29800)
    parse_address("[fe80::1]:29800", ...)              IPv6 in brackets
    parse_address(":29800", ..., listening=True)       every interface (a listener only: rank zero, an agent)

A host is a name or a numeric address; connecting resolves it once and sends to nothing else.
"""

from __future__ import annotations

import re
import socket
from dataclasses import dataclass

from flare.errors import UsageError

_ADDRESS = re.compile(r"(?:\[(?P<v6>[0-9A-Fa-f:.%\w]+)\]|(?P<host>[^\s:\[\]]*)):(?P<port>\d+)")


@dataclass(frozen=True)
class Address:
    host: str                  # "" on a listener: every interface
    port: int

    def __str__(self) -> str:
        return f"[{self.host}]:{self.port}" if ":" in self.host else f"{self.host}:{self.port}"

    @property
    def bind_host(self) -> str:
        return self.host or "0.0.0.0"

    def with_port(self, port: int) -> "Address":
        return Address(self.host, port)


def parse_address(text: str, flag: str, listening: bool = False, default_port: int | None = None) -> Address:
    """`text` as HOST:PORT; with `default_port`, a bare HOST too. UsageError naming `flag` otherwise."""
    text = text.strip()
    if default_port is not None and _ADDRESS.fullmatch(text) is None:
        text = f"{text}:{default_port}"
    match = _ADDRESS.fullmatch(text)
    if match is None:
        raise UsageError(f"{flag} {text!r} is not HOST:PORT (write IPv6 addresses in brackets, such as "
                         "[fe80::1]:29800)")
    host = match["v6"] if match["v6"] is not None else match["host"]
    port = int(match["port"])
    if not 1 <= port <= 65535:
        raise UsageError(f"{flag} {text}: port {port} is outside 1-65535")
    if not host and not listening:
        raise UsageError(f"{flag} {text} names no host: give the address of the host to connect to, "
                         f"such as 10.0.0.5:{port}")
    return Address(host, port)


def connect(address: Address, timeout: float) -> socket.socket:
    """A TCP connection to `address` and nowhere else; the caller words an OSError for its user."""
    sock = socket.create_connection((address.host, address.port), timeout=timeout)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock


def listen(address: Address, what: str, backlog: int = 64) -> socket.socket:
    """A listening TCP socket on `address`; UsageError naming `what` when the port is taken."""
    family = socket.AF_INET6 if ":" in address.bind_host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((address.bind_host, address.port))
        sock.listen(backlog)
    except OSError as error:
        sock.close()
        raise UsageError(f"cannot listen for {what} on {address}: {error.strerror}; choose another port or "
                         "stop the process using it") from None
    return sock
