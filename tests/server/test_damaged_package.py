"""`flare run` on a package whose weight header was damaged after export: the exit-5 message, no traceback."""

from __future__ import annotations

import subprocess
from pathlib import Path

from tests.server.conftest import FlareProcess, cli_env, export_package


def test_flare_run_refuses_a_damaged_weight_header_with_exit_5(tmp_path, stories260k):
    home = tmp_path / "home"
    home.mkdir()
    entry = export_package(stories260k, home)
    payload = Path(entry) / "weights" / "layer-001.safetensors"
    data = payload.read_bytes()
    index = data.index(b'"shape"')
    payload.unlink()                                      # a hard link to its read-only blob
    payload.write_bytes(data[:index + 1] + b"shapf" + data[index + 6:])
    done = subprocess.run(FlareProcess(home, "stories260k").args, env=cli_env(home), capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 5
    assert "error: payload weights/layer-001.safetensors is corrupt: the header entry of tensor" in done.stderr
    assert "Traceback" not in done.stderr + done.stdout
