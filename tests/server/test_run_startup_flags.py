"""`flare run` flags that used to be environment variables or silent: the engine core's start-up
profile is a flag (spec §1: Flare reads no environment variable for it), and accepting a publisher
with the --dangerously-* flags says that the acceptance is remembered. A real `flare run` subprocess."""

from __future__ import annotations

import subprocess

from tests.server.conftest import FlareProcess, cli_command, cli_env, export_package


def test_profile_startup_is_a_flag_and_the_environment_variable_does_nothing(tmp_path, stories260k):
    home = tmp_path / "home"
    home.mkdir()
    entry = export_package(stories260k, home, "--max-concurrency", "2")
    by_flag, by_variable = tmp_path / "by-flag", tmp_path / "by-variable"
    process = FlareProcess(home, entry, "--profile-startup", str(by_flag))
    process.environment = {"FLARE_PROFILE_STARTUP": str(by_variable)}
    process.start()
    try:
        log = process.log
    finally:
        process.stop()
    assert [path.suffix for path in by_flag.iterdir()] == [".prof"]
    assert not by_variable.exists()
    assert f"remembered in {home / '.config' / 'flare' / 'trust.toml'}" in log
    assert "--dangerously-approve-key and --dangerously-accept-publisher" in log


def test_profile_steps_records_its_window_of_serving_steps(tmp_path, stories260k):
    """Steps 2..4 traced (host operators, each step marked and summarized), 5..7 under cProfile."""
    import gzip
    import json
    import pstats

    import httpx

    home = tmp_path / "home"
    home.mkdir()
    entry = export_package(stories260k, home, "--max-concurrency", "2")
    traces = tmp_path / "steps"
    process = FlareProcess(home, entry, "--profile-steps", str(traces), "--profile-steps-window", "2,3")
    process.start()
    try:
        reply = httpx.post(process.url + "/v1/completions", timeout=60,
                           json={"model": "stories260k", "prompt": "Once upon a time", "max_tokens": 12,
                                 "temperature": 0})
        assert reply.status_code == 200, reply.text
    finally:
        process.stop()
    [trace] = traces.glob("engine-steps-*.json.gz")
    events = json.load(gzip.open(trace, "rt"))["traceEvents"]
    assert sum(1 for e in events if e.get("name") == "flare.step" and e.get("ph") == "X") == 3
    summary = next(traces.glob("engine-steps-*.txt")).read_text().splitlines()
    assert summary[0].split()[:3] == ["step", "wall", "ms"] and len(summary) == 1 + 3 + 1
    [profile] = traces.glob("engine-steps-*.prof")
    functions = {name for _, _, name in pstats.Stats(str(profile)).stats}
    assert "step" in functions


def test_a_step_window_without_profile_steps_is_refused(tmp_path, stories260k):
    home = tmp_path / "home"
    home.mkdir()
    entry = export_package(stories260k, home, "--max-concurrency", "2")
    done = subprocess.run(cli_command("flare", "run", entry, "--profile-steps-window", "2,3"), env=cli_env(home),
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr
    assert "--profile-steps-window sets the window of --profile-steps" in done.stderr
