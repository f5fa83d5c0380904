"""`flare run` flags that used to be environment variables or silent: the engine core's start-up
profile is a flag (spec §1: Flare reads no environment variable for it), and accepting a publisher
with the --dangerously-* flags says that the acceptance is remembered. A real `flare run` subprocess."""

from __future__ import annotations

from tests.server.conftest import FlareProcess, export_package


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
