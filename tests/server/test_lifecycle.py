"""How `flare run` starts and stops, through real subprocesses: the port checked before the model loads,
SIGTERM to the whole process group drains like SIGTERM to the server, and a dead engine core makes the
server exit non-zero instead of answering 503 forever."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import threading
import time
from pathlib import Path

import httpx
import openai
import pytest

from tests.server.conftest import FlareProcess, cli_command, cli_env, development_fingerprint, export_package

PROMPT = "Once upon a time, there was a little girl"


@pytest.fixture(scope="module")
def home(tmp_path_factory, stories260k):
    home = tmp_path_factory.mktemp("flare-home")
    export_package(stories260k, home, "--max-concurrency", "8")
    return home


def flare_run(home, *flags: str) -> subprocess.CompletedProcess:
    trust = ("--offline", "--dangerously-approve-key", development_fingerprint(home),
             "--dangerously-accept-publisher", "local-development")
    return subprocess.run(cli_command("flare", "run", "stories260k", "--host", "127.0.0.1", *trust, *flags),
                          env=cli_env(home), capture_output=True, text=True, timeout=120)


def stream_in_thread(server: FlareProcess, max_tokens: int) -> tuple[threading.Thread, dict]:
    """A completion streaming in a thread: its text pieces, final usage, and the error that ended it if any."""
    seen: dict = {"pieces": [], "usage": None, "error": None}
    client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)

    def run() -> None:
        try:
            for chunk in client.completions.create(model="stories260k", prompt=PROMPT, max_tokens=max_tokens,
                                                   stream=True, stream_options={"include_usage": True},
                                                   extra_body={"ignore_eos": True}):
                seen["pieces"].extend(choice.text for choice in chunk.choices)
                if chunk.usage is not None:
                    seen["usage"] = chunk.usage.completion_tokens
        except Exception as error:
            seen["error"] = error

    reader = threading.Thread(target=run)
    reader.start()
    return reader, seen


def wait_until(condition, timeout_s: float = 30) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False


def engine_core_pid(server_pid: int) -> int:
    """The engine-core process among the server's children (a multiprocessing spawn child)."""
    children = Path(f"/proc/{server_pid}/task/{server_pid}/children").read_text().split()
    for child in children:
        if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
            return int(child)
    raise AssertionError(f"no engine-core process among the server's children {children}")


def test_a_port_out_of_range_is_refused_by_its_flag(home):
    done = flare_run(home, "--port", "70000")
    assert done.returncode == 2
    assert "--port" in done.stderr and "70000" in done.stderr and "65535" in done.stderr
    assert "Load weights" not in done.stderr


def test_a_busy_port_is_reported_before_the_model_loads(home):
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        done = flare_run(home, "--port", str(port))
    assert done.returncode == 2
    assert f"cannot listen on 127.0.0.1 port {port}" in done.stderr and "--port" in done.stderr
    assert "Verify package" not in done.stderr and "Load weights" not in done.stderr


def test_sigterm_to_the_process_group_drains_streams_then_exits(home):
    server = FlareProcess(home, "stories260k", own_process_group=True).start()
    try:
        readers = [stream_in_thread(server, 200) for _ in range(2)]
        assert wait_until(lambda: all(seen["pieces"] for _, seen in readers))
        core = engine_core_pid(server.process.pid)
        os.killpg(server.process.pid, signal.SIGTERM)      # what docker stop, systemd and job control send
        for reader, _ in readers:
            reader.join(timeout=60)
        assert [(seen["error"], seen["usage"]) for _, seen in readers] == [(None, 200), (None, 200)]
        assert server.process.wait(timeout=60) == 0
        assert wait_until(lambda: not Path(f"/proc/{core}").exists() or _is_zombie(core), timeout_s=10)
    finally:
        server.stop()
    log = server.log
    assert "Shutting down (SIGTERM received): finishing 2 active requests" in log     # redirected: still said
    assert "the requests are done; stopping the engine" in log and log.rstrip().endswith("Stopped")
    assert "exited (exit code" not in log


def test_a_dead_engine_core_fails_the_streams_and_the_server_exits_1(home):
    server = FlareProcess(home, "stories260k", own_process_group=True).start()
    try:
        reader, seen = stream_in_thread(server, 400)
        assert wait_until(lambda: seen["pieces"])
        os.kill(engine_core_pid(server.process.pid), signal.SIGKILL)
        health = []
        while server.process.poll() is None:
            try:
                health.append(httpx.get(server.url + "/health", timeout=2).status_code)
            except httpx.HTTPError:
                pass
            time.sleep(0.02)
        reader.join(timeout=30)
        assert server.process.returncode == 1
        noticed = next((i for i, status in enumerate(health) if status != 200), len(health))   # the kill takes a moment to see
        assert 200 not in health[noticed:]            # never healthy again once the core is known gone
    finally:
        server.stop()
    assert isinstance(seen["error"], openai.APIError) and "engine" in str(seen["error"])
    assert "Traceback" not in str(seen["error"])
    assert seen["usage"] is None and len(seen["pieces"]) < 400
    log = server.log
    assert "the engine core exited (exit code -9)" in log
    assert "exiting with status 1 so that a supervisor restarts the server" in log


def _is_zombie(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ", 1)[1].startswith("Z")
    except FileNotFoundError:
        return True
