"""Multi-rank packages and rank processes on loopback for the multi-host tests.

`export_ranks(home, ranks)` publishes stories260k as a package of `ranks` ranks in `home`'s cache,
signed by that home's development key, without preparing a model (the package layer needs none).
`RankProcess` runs `flare run ... --rank K --rendezvous 127.0.0.1:PORT` with its own home directory, as
if on its own host.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path

from tests.server.conftest import cli_command, cli_env, free_port

STORIES260K = Path(__file__).resolve().parents[1] / "fixtures" / "stories260k"


def export_ranks(home: Path, ranks: int) -> Path:
    """A signed entry of `ranks` ranks in `home`'s model cache (written in this process, with HOME set)."""
    from flare.package.export import ExportSpec, export_entry
    from flare.package.manifest import GraphCatalog, Plan, Preparation
    from flare.package.signing import development_identity
    from flare.package.store import ModelCache

    config_dir = home / ".config" / "flare"
    config_dir.mkdir(parents=True, exist_ok=True)
    plan = Plan(dtype="float32", page_size=16, prefill_chunk=256, compile=False, max_concurrency=4,
                decode_capacities=(1, 2, 4), max_model_len=None, memory_reserve_bytes=0, tensor_parallel=ranks)
    spec = ExportSpec(model_id="stories260k", served_names=("stories260k",), checkpoint_dir=STORIES260K,
                      hf_config=json.loads((STORIES260K / "config.json").read_text()), plan=plan,
                      preparation=Preparation("cpu", ()), graphs=GraphCatalog((), "no graphs on a CPU"))
    return export_entry(spec, ModelCache(home / ".cache" / "flare" / "packages"), development_identity(config_dir))


def dev_fingerprint(home: Path) -> str:
    from flare.package.signing import Profile

    return Profile.load(home / ".config" / "flare" / "development-publisher.json").keys[0].fingerprint


def approval(fingerprint: str) -> tuple[str, ...]:
    return ("--offline", "--dangerously-approve-key", fingerprint, "--dangerously-accept-publisher",
            "local-development")


class RankProcess:
    """One `flare run` rank in its own home; output kept in a log file."""

    def __init__(self, home: Path, *args: str, environment: dict | None = None) -> None:
        home.mkdir(parents=True, exist_ok=True)
        self.home = home
        self.log_path = home / f"rank-{time.monotonic_ns()}.log"
        env = {**cli_env(home), **(environment or {})}
        self.log_file = open(self.log_path, "w")
        self.process = subprocess.Popen(cli_command("flare", "run", *args), env=env, stdout=self.log_file,
                                        stderr=subprocess.STDOUT)

    @property
    def log(self) -> str:
        return self.log_path.read_text()

    def wait(self, timeout: float = 120) -> int:
        try:
            return self.process.wait(timeout=timeout)
        finally:
            self.log_file.close()

    def wait_for(self, text: str, timeout: float = 60) -> None:
        deadline = time.monotonic() + timeout
        while text not in self.log:
            if self.process.poll() is not None or time.monotonic() > deadline:
                raise AssertionError(f"{text!r} never appeared:\n{self.log}")
            time.sleep(0.1)

    def kill(self) -> None:
        if self.process.poll() is None:
            self.process.kill()
            self.process.wait()
        self.log_file.close()


def rendezvous() -> str:
    return f"127.0.0.1:{free_port()}"


def stop_all(processes) -> None:
    for process in processes:
        process.kill()
    for process in processes:
        if not process.log_file.closed:
            process.log_file.close()


os.environ.setdefault("OMP_NUM_THREADS", "1")
