"""The server's stop, in-process with a stand-in engine: a drain that outlasts its limit ends the requests
still running with the drain's answer, an engine that dies stops the server with status 1, and a stop that
hangs is ended by the watchdog."""

from __future__ import annotations

import io
import signal
import threading
import time

import httpx

from flare.server import stopping
from flare.server.app import build_app
from flare.server.frontend import ServingFrontend
from flare.server.settings import ServerSettings
from tests.server.conftest import free_port
from tests.server.standin_engine import StandinEngine


class Served:
    def __init__(self, stories260k, delay: float) -> None:
        frontend = ServingFrontend.from_dir(stories260k)
        self.engine = StandinEngine(frontend, delay=delay)
        app = build_app(self.engine, frontend, ServerSettings(("tiny",), "tiny", 4096, 4))
        self.port = free_port()
        self.said = io.StringIO()
        config = stopping.uvicorn_config(app, quiet=True)
        config.host, config.port = "127.0.0.1", self.port
        self.server = stopping.StoppingServer(config, app.state.serving, self.said)
        self.thread = threading.Thread(target=self.server.run)

    def __enter__(self) -> "Served":
        self.thread.start()
        deadline = time.monotonic() + 20
        while not self.server.started and time.monotonic() < deadline:
            time.sleep(0.02)
        return self

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)
        self.server.disarm_watchdog()


def stream_lines(port: int, max_tokens: int, lines: list[str]) -> threading.Thread:
    def read() -> None:
        body = {"model": "tiny", "prompt": "Once upon a time", "max_tokens": max_tokens, "stream": True}
        with httpx.stream("POST", f"http://127.0.0.1:{port}/v1/completions", json=body, timeout=60) as reply:
            lines.extend(line for line in reply.iter_lines() if line)
    reader = threading.Thread(target=read)
    reader.start()
    return reader


def test_a_drain_past_its_limit_ends_the_requests_with_the_drains_answer(stories260k, monkeypatch):
    monkeypatch.setattr(stopping, "DRAIN_TIMEOUT_S", 0.5)
    with Served(stories260k, delay=0.05) as served:
        lines: list[str] = []
        reader = stream_lines(served.port, 2000, lines)          # 100 s of tokens: longer than the drain
        while not lines:
            time.sleep(0.02)
        served.server.handle_exit(signal.SIGTERM, None)
        reader.join(timeout=30)
        served.thread.join(timeout=30)
        assert not served.thread.is_alive() and served.server.exit_status == 0
    assert '"error"' in lines[-1] and "the engine was shut down" in lines[-1]
    said = served.said.getvalue()
    assert "Shutting down (SIGTERM received): finishing" in said
    assert "still running after" in said and "ending them" in said


def test_an_engine_that_dies_stops_the_server_with_status_1(stories260k):
    with Served(stories260k, delay=0.0) as served:
        served.engine.dead_reason = "the engine core exited (exit code -9)"
        served.thread.join(timeout=10)
        assert not served.thread.is_alive()
    assert served.server.exit_status == stopping.ENGINE_FAILED
    assert "the engine core stopped: the engine core exited (exit code -9)" in served.said.getvalue()


def test_a_stop_that_hangs_past_its_bound_exits_the_process(monkeypatch):
    """Whatever still runs (a stuck engine, a client that never reads), the process exits EXIT_TIMEOUT_S
    after the stop began, saying so; a disarmed watchdog (a server inside a longer-lived process) does not."""
    from types import SimpleNamespace

    exits: list[int] = []
    monkeypatch.setattr(stopping, "EXIT_TIMEOUT_S", 0.2)
    monkeypatch.setattr(stopping.os, "_exit", exits.append)

    def stopping_server():
        engine = SimpleNamespace(stats=lambda: SimpleNamespace(num_running=1, num_waiting=0), dead_reason=None)
        state = SimpleNamespace(engine=engine, draining=False, ready=True)
        said = io.StringIO()
        return stopping.StoppingServer(stopping.uvicorn_config(lambda *_: None, quiet=True), state, said), said

    server, said = stopping_server()
    server._begin("SIGTERM received", drain=True)
    deadline = time.monotonic() + 10
    while not exits and time.monotonic() < deadline:
        time.sleep(0.02)
    assert exits == [stopping.ENGINE_FAILED]
    assert "after the stop began; exiting now" in said.getvalue()

    server, said = stopping_server()
    server._begin("SIGTERM received", drain=True)
    server.disarm_watchdog()
    time.sleep(0.5)
    assert exits == [stopping.ENGINE_FAILED] and "exiting now" not in said.getvalue()
