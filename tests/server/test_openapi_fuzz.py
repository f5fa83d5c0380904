"""A bounded fuzz run over the served OpenAPI document (schemathesis, through benchmarks/fuzz_openapi.py)
against a real `flare run` on loopback: a fixed seed and example budget, and not one response >= 500 and
not one request left hanging. Longer runs: the script itself (see its docstring)."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.server.conftest import REPO_ROOT, FlareProcess, cli_env, export_package

KEY = "sk-flare-fuzz"
EXAMPLES = 10                      # per operation: about 30 s on two CPU cores
SEED = 0


@pytest.fixture(scope="module")
def server(tmp_path_factory, stories260k):
    home = tmp_path_factory.mktemp("flare-home")
    export_package(stories260k, home, "--max-concurrency", "8")
    key_file = home / "api-key"
    key_file.write_text(KEY + "\n")
    process = FlareProcess(home, "stories260k", "--served-model-name", "tiny-stories", "--api-key-file",
                           str(key_file))
    process.start()
    yield process
    process.stop()


@pytest.mark.slow
def test_fuzzing_the_openapi_document_finds_no_server_error_and_no_hang(server, tmp_path):
    output = tmp_path / "fuzz.json"
    done = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "fuzz_openapi.py"), "--base-url", server.url,
                           "--api-key", KEY, "--max-examples", str(EXAMPLES), "--seed", str(SEED), "--phases", "fuzzing",
                           "--request-timeout", "60", "--output", str(output)],
                          env=cli_env(server.home), capture_output=True, text=True, timeout=400)
    assert output.is_file(), done.stdout + done.stderr
    result = json.loads(output.read_text())
    assert result["status"] == "complete", done.stdout
    assert (result["server_errors"], result["hangs"]) == (0, 0), done.stdout
    assert done.returncode == 0, done.stdout + done.stderr
    operations = result["operations"]
    for route in ("POST /v1/chat/completions", "POST /v1/completions", "POST /v1/responses", "POST /v1/messages",
                  "POST /v1/messages/count_tokens"):
        # each route both served valid requests and refused broken ones
        assert operations[route]["2xx"] > 0 and operations[route]["4xx"] > 0, (route, operations[route])
    assert result["test_cases"] >= 5 * len(operations)
    assert not any(entry["network_errors"] for entry in operations.values())
    assert "Exception in ASGI application" not in server.log
