"""The orbit flow on loopback: pair -> push -> run -> status -> stop, and what pairing and builds refuse."""

from __future__ import annotations

import shutil
import time

import httpx
import pytest

from tests.hosts.orbit_hosts import JOIN_CODE, AgentProcess, flare_cli
from tests.hosts.ranks import dev_fingerprint, export_ranks
from tests.server.conftest import REPO_ROOT, free_port


def no_traceback(done) -> str:
    assert "Traceback" not in done.stderr, done.stderr
    return done.stderr


@pytest.fixture
def agent(hosts):
    process = AgentProcess(hosts(1))
    yield process
    process.stop()


def test_pair_push_run_status_stop(hosts, agent, monkeypatch):
    controller = hosts(0)
    monkeypatch.setenv("HOME", str(controller))
    entry = export_ranks(controller, 1)
    paired = flare_cli(controller, "orbit", "pair", agent.address, "--code", JOIN_CODE.lower(), "--cluster", "lab")
    assert paired.returncode == 0, paired.stderr
    assert f"paired {agent.address}" in paired.stdout
    pushed = flare_cli(controller, "orbit", "push", str(entry), "--to", agent.address, "--transfer-streams", "3")
    assert pushed.returncode == 0, pushed.stderr
    on_node = hosts(1) / ".cache" / "flare" / "packages" / "models" / "stories260k" / entry.name
    assert (on_node / "model.safetensors").is_file()
    listing = flare_cli(controller, "orbit", "packages")
    assert f"stories260k@{entry.name}  whole package" in listing.stdout
    port = free_port()
    started = flare_cli(controller, "orbit", "run", str(entry), "--cluster", "lab", "--port", str(port),
                        "--max-concurrency", "2", "--detach", "--dangerously-approve-key", dev_fingerprint(controller),
                        "--dangerously-accept-publisher", "local-development")
    assert started.returncode == 0, started.stderr
    assert "(0 bytes sent)" in started.stderr                 # pushed before: nothing moves again
    try:
        wait_healthy(f"http://127.0.0.1:{port}")
        reply = httpx.post(f"http://127.0.0.1:{port}/v1/completions", timeout=60,
                           json={"model": "stories260k", "prompt": "Once upon a time", "max_tokens": 4,
                                 "temperature": 0}).json()
        assert reply["usage"]["completion_tokens"] == 4
        status = flare_cli(controller, "orbit", "status")
        assert status.returncode == 0 and "ranks running: 1" in status.stdout
        groups = flare_cli(controller, "orbit", "ls")
        assert "lab  rank 0/1" in groups.stdout and "running" in groups.stdout
        assert "--max-concurrency=2" in (hosts(1) / ".config/flare/agent/groups/lab/rank-0.json").read_text()
        board = flare_cli(controller, "orbit", "dashboard")
        assert "generated tokens 4" in board.stdout, board.stdout + board.stderr
    finally:
        stopped = flare_cli(controller, "orbit", "stop", "lab")
    assert stopped.returncode == 0, stopped.stderr
    assert "stopped, status 0" in flare_cli(controller, "orbit", "ls").stdout
    assert flare_cli(controller, "orbit", "rm", "lab").returncode == 0
    assert "no groups" in flare_cli(controller, "orbit", "ls").stdout


def wait_healthy(url: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    raise AssertionError(f"{url} never became healthy")


def test_a_wrong_code_is_refused_and_nothing_is_recorded(hosts, agent):
    done = flare_cli(hosts(0), "orbit", "pair", agent.address, "--code", "WRNG-CODE-HERE")
    assert done.returncode == 2 and "refused the pairing code" in no_traceback(done)
    assert not (hosts(0) / ".config" / "flare" / "orbit.toml").exists()
    asked = flare_cli(hosts(0), "orbit", "status")
    assert asked.returncode == 2 and "no paired nodes" in no_traceback(asked)


def test_an_unpaired_controller_is_refused_by_the_agent(hosts, agent):
    assert flare_cli(hosts(0), "orbit", "pair", agent.address, "--code", JOIN_CODE).returncode == 0
    shutil.copy(hosts(0) / ".config/flare/orbit.toml", _config(hosts(2)) / "orbit.toml")   # a stranger's key
    done = flare_cli(hosts(2), "orbit", "status")
    assert done.returncode == 1 and "has not paired with controller" in done.stdout


def test_a_reset_agent_forgets_its_controllers(hosts, agent):
    assert flare_cli(hosts(0), "orbit", "pair", agent.address, "--code", JOIN_CODE).returncode == 0
    assert flare_cli(hosts(1), "agent", "reset").returncode == 0
    done = flare_cli(hosts(0), "orbit", "ls")
    assert done.returncode != 0 and "has not paired" in no_traceback(done)


def test_an_agent_of_another_build_is_refused_naming_both_before_any_rank_starts(hosts, tmp_path, monkeypatch):
    from flare.hosts.build import this_build

    other = tmp_path / "other-build"
    shutil.copytree(REPO_ROOT / "src", other, ignore=shutil.ignore_patterns("__pycache__"))
    (other / "flare/orbit/agent.py").write_text((other / "flare/orbit/agent.py").read_text() + "\n# changed\n")
    monkeypatch.setenv("HOME", str(hosts(0)))
    entry = export_ranks(hosts(0), 1)
    same = AgentProcess(hosts(1))
    try:
        assert flare_cli(hosts(0), "orbit", "pair", same.address, "--code", JOIN_CODE).returncode == 0
    finally:
        same.stop()
    upgraded = AgentProcess(hosts(1), environment={"PYTHONPATH": str(other)}, install=False, port=same.port)
    try:
        done = flare_cli(hosts(0), "orbit", "run", str(entry), "--detach", "--dangerously-approve-key",
                         dev_fingerprint(hosts(0)), "--dangerously-accept-publisher", "local-development")
        status = flare_cli(hosts(0), "orbit", "status")
    finally:
        upgraded.stop()
    assert done.returncode == 2
    error = no_traceback(done)
    assert f"source {this_build().source}" in error and error.count("(source ") == 2 and "same build" in error
    assert not (hosts(1) / ".config/flare/agent/groups").exists()          # no rank started
    assert not (hosts(1) / ".cache/flare/packages/models").exists()       # nor was the package pushed
    assert status.returncode == 1 and "not ready" in status.stdout and "same build" in status.stdout


def _config(home):
    path = home / ".config" / "flare"
    path.mkdir(parents=True, exist_ok=True)
    return path


def test_flare_run_hosts_starts_peers_through_paired_agents(hosts, monkeypatch):
    from tests.hosts.ranks import RankProcess, approval, rendezvous

    head = hosts(0)
    monkeypatch.setenv("HOME", str(head))
    entry = export_ranks(head, 3)
    agents = [AgentProcess(hosts(k)) for k in (1, 2)]
    try:
        paired = flare_cli(head, "agent", "pair", *(agent.address for agent in agents), "--code", JOIN_CODE)
        assert paired.returncode == 0, paired.stderr
        zero = RankProcess(head, str(entry), "--hosts", ",".join(agent.address for agent in agents),
                           "--rendezvous", rendezvous(), "--stage-only", *approval(dev_fingerprint(head)))
        assert zero.wait() == 0, zero.log
    finally:
        for agent in agents:
            agent.stop()
    assert "Staged stories260k" in zero.log
    for k in (1, 2):
        copy = hosts(k) / ".cache/flare/packages/ranks/stories260k" / entry.name / f"rank-{k}"
        assert (copy / "model.safetensors").is_file()
        log = next((hosts(k) / ".config/flare/agent/groups").glob(f"*/rank-{k}.log")).read_text()
        assert f"Rank {k}: rank zero staged" in log


def test_hosts_that_were_never_paired_are_refused_before_anything_starts(hosts, monkeypatch):
    from tests.hosts.ranks import approval

    monkeypatch.setenv("HOME", str(hosts(0)))
    entry = export_ranks(hosts(0), 2)
    done = flare_cli(hosts(0), "run", str(entry), "--hosts", "127.0.0.1:1", "--stage-only",
                     *approval(dev_fingerprint(hosts(0))))
    assert done.returncode == 2 and "no node '127.0.0.1:1'" in no_traceback(done)


def test_orbit_run_stages_a_two_rank_package_on_two_nodes(hosts, monkeypatch):
    from tests.hosts.ranks import rendezvous

    controller = hosts(0)
    monkeypatch.setenv("HOME", str(controller))
    entry = export_ranks(controller, 2)
    agents = [AgentProcess(hosts(k)) for k in (1, 2)]
    try:
        for agent in agents:
            assert flare_cli(controller, "orbit", "pair", agent.address, "--code", JOIN_CODE, "--cluster",
                             "duo").returncode == 0
        dry = flare_cli(controller, "orbit", "run", str(entry), "--dry-run", "--rendezvous", rendezvous(),
                        "--dangerously-approve-key", dev_fingerprint(controller), "--dangerously-accept-publisher",
                        "local-development")
        assert dry.returncode == 0 and "--rank 1" in dry.stdout and "--rank 0" in dry.stdout, dry.stderr
        assert not (hosts(1) / ".config/flare/agent/groups").exists()
        done = flare_cli(controller, "orbit", "run", str(entry), "--stage-only", "--rendezvous", rendezvous(),
                         "--name", "duo-stage", "--persistent", "--dangerously-approve-key",
                         dev_fingerprint(controller), "--dangerously-accept-publisher", "local-development")
        assert done.returncode == 0, done.stderr
        assert "Staged stories260k" in done.stdout
        saved = (controller / ".config/flare/orbit.toml").read_text()
        assert '[groups.duo-stage]' in saved and "--stage-only" in saved
        again = flare_cli(controller, "orbit", "run", "--name", "duo-stage", "--rendezvous", rendezvous())
        assert again.returncode == 0 and "0.00 GiB received" in again.stdout, again.stderr
    finally:
        for agent in agents:
            agent.stop()
    copy = hosts(2) / ".cache/flare/packages/ranks/stories260k" / entry.name / "rank-1"
    assert (copy / "model.safetensors").is_file()
