"""The HTTP listener: the port reserved before the model loads, then uvicorn serving the app until it stops.

    listener = reserve(host, port)          # bound at once: a busy port fails before loading
    ...                                     # load the model
    listener.listen()                       # the Start HTTP stage
    run_http(engine, frontend, settings, listener, stream, dashboard)    # -> the exit status

The port's range (1-65535) is checked where it is chosen: `flare.config.PORT`, by `resolve`.
How it stops (signals, the engine core's death, the bounds) is `flare.server.stopping`.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any, TextIO

from flare.engine_client.protocol import EngineClient
from flare.errors import UsageError
from flare.server.frontend import ServingFrontend
from flare.server.settings import ServerSettings


@dataclass(frozen=True)
class Listener:
    host: str
    port: int
    socket: socket.socket

    @property
    def url(self) -> str:
        return f"http://[{self.host}]:{self.port}" if ":" in self.host else f"http://{self.host}:{self.port}"

    def listen(self) -> None:
        """Start taking connections (they wait in the backlog until the server runs)."""
        try:
            self.socket.listen(2048)
        except OSError as error:               # another server bound the port too and listened first
            raise _in_use(self.host, self.port, error) from None
        self.socket.setblocking(False)

    def close(self) -> None:
        self.socket.close()


def reserve(host: str, port: int) -> Listener:
    """The port bound (not yet listening) on a numeric IPv4 or IPv6 address; UsageError if it is taken."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST | socket.AI_PASSIVE)[0]
    except socket.gaierror:
        raise UsageError(f"--host {host} is not a numeric IPv4 or IPv6 address (for IPv6 write it unbracketed, "
                         "such as --host ::1)") from None
    bound = socket.socket(family, kind, proto)
    bound.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == socket.AF_INET6:
        bound.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    try:
        bound.bind(address)
    except OSError as error:
        bound.close()
        raise _in_use(host, port, error) from None
    return Listener(host, port, bound)


def _in_use(host: str, port: int, error: OSError) -> UsageError:
    return UsageError(f"cannot listen on {host} port {port}: {error.strerror}; choose another --port "
                      "or stop the process using it")


def run_http(engine: EngineClient, frontend: ServingFrontend, settings: ServerSettings, listener: Listener, stream: TextIO,
             dashboard: Any = None) -> int:
    """Serve until a signal drains the server or the engine core dies; returns the exit status.
    `dashboard` (flare.ui.dashboard.Dashboard) is live meanwhile."""
    from flare.server.app import build_app
    from flare.server.stopping import StoppingServer, uvicorn_config

    app = build_app(engine, frontend, settings)
    if dashboard is not None:
        dashboard.attach(app.state.serving)
    server = StoppingServer(uvicorn_config(app, quiet=dashboard is not None), app.state.serving, stream, dashboard)
    if dashboard is not None:
        dashboard.start()
    try:
        server.run(sockets=[listener.socket])
    finally:
        if dashboard is not None:
            dashboard.stop()
    return server.exit_status
