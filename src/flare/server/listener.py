"""The HTTP listener: a socket bound before the server starts (so a busy port fails the Start HTTP stage),
and uvicorn serving the app until SIGINT/SIGTERM, after the active requests have drained."""

from __future__ import annotations

import socket
from typing import Any

from flare.errors import UsageError
from flare.server.settings import ServerSettings


def open_listener(host: str, port: int) -> socket.socket:
    """A bound, listening socket on a numeric IPv4 or IPv6 address."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST | socket.AI_PASSIVE)[0]
    except socket.gaierror:
        raise UsageError(f"--host {host} is not a numeric IPv4 or IPv6 address (for IPv6 write it unbracketed, "
                         "such as --host ::1)") from None
    listener = socket.socket(family, kind, proto)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == socket.AF_INET6:
        listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    try:
        listener.bind(address)
    except OSError as error:
        listener.close()
        raise UsageError(f"cannot listen on {host} port {port}: {error.strerror}; choose another --port "
                         "or stop the process using it") from None
    listener.listen(2048)
    listener.setblocking(False)
    return listener


def url_for(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def run_http(engine: Any, frontend: Any, settings: ServerSettings, listener: socket.socket,
             dashboard: Any = None) -> int:
    """Serve until a signal drains the server. `dashboard` (flare.ui.dashboard.Dashboard) is live meanwhile."""
    import uvicorn

    from flare.server.app import build_app

    app = build_app(engine, frontend, settings)
    state = app.state.serving

    class DrainingServer(uvicorn.Server):
        """On SIGINT/SIGTERM: /health turns 503, no new connections, active requests finish, then exit."""

        def handle_exit(self, sig, frame) -> None:
            if dashboard is not None:
                dashboard.drain()          # hand the terminal back before the drain is reported
            state.draining = True
            state.ready = False
            super().handle_exit(sig, frame)
            # uvicorn re-raises a handled signal after shutdown; the drain is the intended exit, status 0
            self._captured_signals.clear()

    if dashboard is not None:
        dashboard.attach(state)
    # No access log ever; under the dashboard only errors, which would otherwise tear the display
    config = uvicorn.Config(app, log_level="warning" if dashboard is None else "error", access_log=False,
                            timeout_graceful_shutdown=None, limit_concurrency=None, backlog=2048)
    server = DrainingServer(config)
    if dashboard is not None:
        dashboard.start()
    try:
        server.run(sockets=[listener])
    finally:
        if dashboard is not None:
            dashboard.stop()
    return 0
