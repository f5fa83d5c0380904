"""Servers for the HTTP tests: one per module, on 127.0.0.1 and a free port."""

from __future__ import annotations

import socket
import threading
import time

import httpx


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class ThreadServer:
    """uvicorn serving an app in a background thread (for stand-in engine tests)."""

    def __init__(self, app) -> None:
        import uvicorn

        self.port = free_port()
        self.server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> "ThreadServer":
        self.thread.start()
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            try:
                httpx.get(self.url + "/health", timeout=1)
                return self
            except httpx.HTTPError:
                time.sleep(0.05)
        raise RuntimeError("the test server did not start")

    def __exit__(self, *exc) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=10)


REPO_ROOT = __import__("pathlib").Path(__file__).resolve().parents[2]
ENTRY_CODE = "import sys; from flare.cli.{tool} import main; sys.exit(main())"


def cli_command(tool: str, *args: str) -> list[str]:
    import sys

    return [sys.executable, "-c", ENTRY_CODE.format(tool=tool), *args]


def cli_env(home) -> dict:
    import os

    env = dict(os.environ)
    env["HOME"] = str(home)
    env["OMP_NUM_THREADS"] = "1"        # as tests/conftest.py: tiny models on many threads thrash two cores
    env["PYTHONPATH"] = str(REPO_ROOT / "src") + os.pathsep + env.get("PYTHONPATH", "")
    return env


def export_package(checkpoint, home, *flags: str) -> str:
    """`ignition export CHECKPOINT` into `home`'s model cache; returns the printed entry path."""
    import subprocess

    config = home / ".config" / "flare" / "config.toml"
    config.parent.mkdir(parents=True, exist_ok=True)
    if not config.exists():
        config.write_text("# test configuration\n")
    done = subprocess.run(cli_command("ignition", "export", str(checkpoint), *flags), env=cli_env(home),
                          capture_output=True, text=True, timeout=300)
    if done.returncode != 0:
        raise RuntimeError(f"ignition export failed ({done.returncode}):\n{done.stderr}")
    return done.stdout.strip().splitlines()[-1]


def development_fingerprint(home) -> str:
    from flare.package.signing import Profile

    return Profile.load(home / ".config" / "flare" / "development-publisher.json").keys[0].fingerprint


class FlareProcess:
    """A real `flare run` subprocess on 127.0.0.1 and a free port; stderr is kept for assertions."""

    def __init__(self, home, target: str, *flags: str, own_process_group: bool = False) -> None:
        self.home = home
        self.own_process_group = own_process_group      # its own group, so a test can signal all of it
        self.port = free_port()
        self.log_path = home / f"flare-run-{self.port}.log"
        self.args = cli_command("flare", "run", target, "--host", "127.0.0.1", "--port", str(self.port),
                                "--offline", "--dangerously-approve-key", development_fingerprint(home),
                                "--dangerously-accept-publisher", "local-development", *flags)
        self.process = None
        self.environment: dict[str, str] = {}     # variables added to the subprocess's environment

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log(self) -> str:
        return self.log_path.read_text()

    def start(self, timeout: float = 120) -> "FlareProcess":
        import subprocess

        self.log_file = open(self.log_path, "w")
        environment = {**cli_env(self.home), **self.environment}
        self.process = subprocess.Popen(self.args, env=environment, stdout=self.log_file,
                                        stderr=subprocess.STDOUT, start_new_session=self.own_process_group)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise RuntimeError(f"flare run exited with {self.process.returncode}:\n{self.log}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"flare run did not become healthy:\n{self.log}")

    def stop(self) -> int | None:
        if self.process is None:
            return None
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=30)
            except Exception:
                self.process.kill()
                self.process.wait()
        self.log_file.close()
        return self.process.returncode
