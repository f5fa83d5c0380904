"""`ignition debug-serve CHECKPOINT`: prepares and serves in one process, writing no package."""

from __future__ import annotations

import signal
import subprocess
import time

import httpx
import openai
import pytest

from tests.server.conftest import cli_command, cli_env, free_port


@pytest.mark.slow
def test_debug_serve_answers_without_writing_a_package(stories260k, tmp_path):
    port = free_port()
    log_path = tmp_path / "debug-serve.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(cli_command("ignition", "debug-serve", str(stories260k), "--port", str(port),
                                               "--max-concurrency", "4"),
                                   env=cli_env(tmp_path), stdout=log, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and process.poll() is None:
            try:
                if httpx.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    break
            except httpx.HTTPError:
                time.sleep(0.1)
        client = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0)
        reply = client.completions.create(model="stories260k", prompt="Once upon a time", max_tokens=8,
                                          temperature=0)
        assert reply.usage.completion_tokens == 8 and reply.choices[0].text.strip()
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=60) == 0
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    output = log_path.read_text()
    assert "Verify package" not in output and "Load weights: OK" in output
    assert "concurrency 4" in output
    assert not (tmp_path / ".cache" / "flare" / "packages").exists()
