"""Agents and a controller on loopback, each host its own home directory."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path

from tests.server.conftest import cli_command, cli_env, free_port

JOIN_CODE = "ABCD-EFGH-JKLM"


class AgentProcess:
    """`flare agent install --join-code` then `flare agent --listen 127.0.0.1:PORT` in its own home."""

    def __init__(self, home: Path, environment: dict | None = None, install: bool = True,
                 port: int | None = None) -> None:
        home.mkdir(parents=True, exist_ok=True)
        self.home, self.port = home, port or free_port()
        self.env = {**cli_env(home), **(environment or {})}
        if install:
            done = subprocess.run(cli_command("flare", "agent", "install", "--join-code", JOIN_CODE), env=self.env,
                                  capture_output=True, text=True, timeout=60)
            assert done.returncode == 0, done.stderr
        self.log_path = home / f"agent-{time.monotonic_ns()}.log"
        self.log_file = open(self.log_path, "w")
        self.process = subprocess.Popen(cli_command("flare", "agent", "--listen", self.address), env=self.env,
                                        stdout=self.log_file, stderr=subprocess.STDOUT)
        deadline = time.monotonic() + 60
        while "listening on" not in self.log:
            assert self.process.poll() is None and time.monotonic() < deadline, self.log
            time.sleep(0.1)

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def log(self) -> str:
        return self.log_path.read_text()

    def stop(self) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(timeout=20)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.log_file.close()


def flare_cli(home: Path, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    return subprocess.run(cli_command("flare", *args), env=cli_env(home), capture_output=True, text=True,
                          timeout=timeout)
