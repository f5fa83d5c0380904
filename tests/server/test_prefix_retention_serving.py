"""`flare run` with the prefix cache's host and disk tiers on an exported stories260k package (CPU): the
start-up report and `flare inspect` say where retained states live, /metrics counts them, and a restart
of the server finds the states the previous run drained to disk, giving the same greedy answer."""

from __future__ import annotations

import json
import subprocess

import httpx
import pytest

from tests.server.conftest import FlareProcess, cli_command, cli_env, export_package

PROMPT = ("Once upon a time, there was a little girl named Lily. She liked to play outside in the park with "
          "her friends. One day, she saw a big red ball under a tree and")


@pytest.fixture(scope="module")
def home(tmp_path_factory, stories260k):
    home = tmp_path_factory.mktemp("retention-home")
    export_package(stories260k, home, "--max-concurrency", "4")
    (home / ".config" / "flare" / "config.toml").write_text(
        '[prefix_cache]\nmemory = "64M"\ndrain_on_shutdown = "10s"\ndisk_limit = "1G"\n'
        f'[paths]\nprefix_cache = "{home / "prefixes"}"\n')
    return home


def complete(server) -> dict:
    answer = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": "stories260k", "prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True})
    answer.raise_for_status()
    return answer.json()


def stats(server) -> dict:
    return httpx.get(server.url + "/v1/engine/stats", timeout=10).json()


def bench(server, home) -> dict:
    """benchmarks/prefix_tiers_bench.py's `evicted` mode: a 300-token prefix, pushed out of the 2,048-token
    GPU pool by 2,400 others, then repeated (and repeated once before that, from the GPU)."""
    import sys

    from tests.server.conftest import REPO_ROOT

    output = home / "bench.json"
    done = subprocess.run([sys.executable, str(REPO_ROOT / "benchmarks" / "prefix_tiers_bench.py"), "evicted",
                           "--base-url", server.url, "--model", "stories260k", "--vocab-size", "512",
                           "--prefix-tokens", "300", "--evict-tokens", "2400", "--repetitions", "1",
                           "--output", str(output)], env=cli_env(home), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(output.read_text())


def inspect(home) -> dict:
    done = subprocess.run(cli_command("flare", "inspect", "stories260k", "--json"), env=cli_env(home),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout)["retained_prefix_states"]


def test_a_restarted_server_finds_the_states_the_last_one_drained(home, tmp_path):
    from tests.server.test_prefix_pool import Manager

    socket = tmp_path / "pool.sock"
    with Manager(f"unix:{socket}", memory=64 << 20):
        first = FlareProcess(home, "stories260k", "--prefix-cache-pool", f"unix:{socket}").start()
        try:
            log = first.log
            assert "prefix cache: GPU pages, then 64.0 MiB of host memory" in log
            assert f"then disk: up to 1.0 GiB under {home / 'prefixes'} (staged)" in log
            assert f"shared with other servers through the pool at unix:{socket}" in log
            assert "the disk holds no pages of this package yet" in log
            answer, saved, measured = serve_and_measure(first, home)
        finally:
            assert first.stop() == 0
        assert "sharing retained states through the pool 'test-pool'" in first.log
    assert measured["gpu_repeat_hit_tokens"] == [288]                 # repeated at once: from the GPU
    assert measured["host_hit_tokens"] == [288] and measured["gpu_hit_tokens"] == [0]
    retained = inspect(home)
    assert retained["host_memory_bytes"] == 64 << 20 and retained["disk_directory"] == str(home / "prefixes")
    [folder] = retained["disk"]
    assert folder["pages"] >= saved["retained_host_pages"] and folder["bytes"] > 0

    second = FlareProcess(home, "stories260k").start()
    try:
        assert f"the disk holds {folder['pages']:,} pages (" in second.log and "from earlier runs" in second.log
        again = complete(second)
        found = stats(second)
        assert again["choices"][0]["text"] == answer["choices"][0]["text"]
        assert found["prefix_cache_disk_hit_tokens"] > 0
        assert again["usage"]["prompt_tokens_details"]["cached_tokens"] == found["prefix_cache_disk_hit_tokens"]
        metrics = httpx.get(second.url + "/metrics", timeout=10).text
        assert (f'flare_prefix_cache_tier_hit_tokens_total{{tier="disk"}} '
                f'{float(found["prefix_cache_disk_hit_tokens"])}') in metrics
    finally:
        second.stop()


def serve_and_measure(server, home) -> tuple[dict, dict, dict]:
    """One answer, the stats after it (its pages saved to the host), /metrics, and the GPU job's client."""
    answer = complete(server)
    saved = stats(server)
    assert saved["retained_host_pages"] > 0 and saved["retained_bytes_gpu_to_host"] > 0
    metrics = httpx.get(server.url + "/metrics", timeout=10).text
    assert 'flare_prefix_retention_pages{tier="host"}' in metrics
    assert 'flare_prefix_retention_bytes_total{direction="gpu_to_host"}' in metrics
    return answer, saved, bench(server, home)


def test_a_pool_ca_without_the_pool_is_refused_before_loading(home):
    done = subprocess.run(cli_command("flare", "run", "stories260k", "--prefix-cache-pool-ca", str(home / "ca.pem")),
                          env=cli_env(home), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2 and "--prefix-cache-pool-ca" in done.stderr and "Load weights" not in done.stderr


def test_inspect_shows_the_prefix_cache_box(home):
    done = subprocess.run(cli_command("flare", "inspect", "stories260k", "--plain"), env=cli_env(home),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "Prefix cache" in done.stdout and "64.0 MiB ([prefix_cache] memory)" in done.stdout
    assert str(home / "prefixes") in done.stdout
