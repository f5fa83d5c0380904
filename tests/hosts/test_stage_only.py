"""`flare run --rank/--rendezvous --stage-only` on loopback: rank zero's package reaches empty peer caches,
verified there; failures end every rank with a one-paragraph error."""

from __future__ import annotations

import os

import pytest

from tests.hosts.ranks import RankProcess, approval, dev_fingerprint, export_ranks, rendezvous, stop_all


def rank_copy(home, entry, rank):
    return home / ".cache" / "flare" / "packages" / "ranks" / entry.parent.name / entry.name / f"rank-{rank}"


def one_paragraph_error(log: str) -> str:
    assert "Traceback" not in log, log
    errors = [line for line in log.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, log
    return errors[0]


@pytest.mark.parametrize("ranks", [2, 4])
def test_rank_zeros_package_reaches_empty_peer_caches_and_is_verified_there(hosts, monkeypatch, ranks):
    monkeypatch.setenv("HOME", str(hosts(0)))
    entry = export_ranks(hosts(0), ranks)
    address = rendezvous()
    trust = approval(dev_fingerprint(hosts(0)))
    zero = RankProcess(hosts(0), str(entry), "--rank", "0", "--rendezvous", address, "--stage-only",
                       "--transfer-streams", "3", *trust)
    peers = [RankProcess(hosts(k), "--rank", str(k), "--rendezvous", address, *trust) for k in range(1, ranks)]
    try:
        assert zero.wait() == 0, zero.log
        for peer in peers:
            assert peer.wait() == 0, peer.log
    finally:
        stop_all([zero, *peers])
    assert f"Staged stories260k@{entry.name} on all {ranks} ranks" in zero.log
    from flare.package.rank_copy import open_rank_copy
    from flare.package.trust import TrustOptions

    for k in range(1, ranks):
        copy = rank_copy(hosts(k), entry, k)
        assert (copy / "model.safetensors").is_file(), peers[k - 1].log
        assert (copy / "frontend.safetensors").is_file()
        assert (copy / f"deployments/tp{ranks}/rank-{k}/graphs.safetensors").is_file()
        assert not (copy / "deployments" / f"tp{ranks}" / "rank-0").exists()     # another rank's files stay home
        monkeypatch.setenv("HOME", str(hosts(k)))
        package = open_rank_copy(copy, k, f"tp{ranks}", TrustOptions(require_acceptance=False))
        assert package.stored_data.payloads == len(list(p for p in copy.rglob("*.safetensors"))) - 1
        assert f"Rank {k}: rank zero staged" in peers[k - 1].log


def test_a_second_launch_reuses_the_peers_copy(hosts, monkeypatch):
    monkeypatch.setenv("HOME", str(hosts(0)))
    entry = export_ranks(hosts(0), 2)
    trust = approval(dev_fingerprint(hosts(0)))
    for attempt in range(2):
        address = rendezvous()
        zero = RankProcess(hosts(0), str(entry), "--rank", "0", "--rendezvous", address, "--stage-only", *trust)
        peer = RankProcess(hosts(1), "--rank", "1", "--rendezvous", address, *trust)
        try:
            assert zero.wait() == 0 and peer.wait() == 0, zero.log + peer.log
        finally:
            stop_all([zero, peer])
    assert "0.00 GiB received" in zero.log


def test_a_byte_altered_in_transit_is_refused(hosts, monkeypatch):
    from tests.hosts.tamper import FlippingProxy

    monkeypatch.setenv("HOME", str(hosts(0)))
    entry = export_ranks(hosts(0), 2)
    address = rendezvous()
    trust = approval(dev_fingerprint(hosts(0)))
    zero = RankProcess(hosts(0), str(entry), "--rank", "0", "--rendezvous", address, "--stage-only", *trust)
    zero.wait_for("waiting for rank")              # the proxy drops a peer that comes before rank zero listens
    with FlippingProxy(address, flip_after=200_000) as proxy:
        peer = RankProcess(hosts(1), "--rank", "1", "--rendezvous", proxy.address, *trust)
        try:
            assert peer.wait() != 0
            assert zero.wait() != 0
        finally:
            stop_all([zero, peer])
    assert proxy.flipped
    error = one_paragraph_error(peer.log)
    assert "altered in transit" in error
    assert "rank 1" in one_paragraph_error(zero.log)
    assert not rank_copy(hosts(1), entry, 1).exists()


def test_a_peer_of_another_build_is_refused_naming_both(hosts, monkeypatch, tmp_path):
    import shutil

    from flare.hosts.build import this_build
    from tests.server.conftest import REPO_ROOT

    other = tmp_path / "other-build"
    shutil.copytree(REPO_ROOT / "src", other, ignore=shutil.ignore_patterns("__pycache__"))
    (other / "flare" / "hosts" / "build.py").write_text((other / "flare/hosts/build.py").read_text() + "\n# changed\n")
    monkeypatch.setenv("HOME", str(hosts(0)))
    entry = export_ranks(hosts(0), 2)
    address = rendezvous()
    trust = approval(dev_fingerprint(hosts(0)))
    zero = RankProcess(hosts(0), str(entry), "--rank", "0", "--rendezvous", address, "--stage-only", *trust)
    peer = RankProcess(hosts(1), "--rank", "1", "--rendezvous", address, *trust,
                       environment={"PYTHONPATH": str(other)})
    try:
        assert peer.wait() == 2, peer.log
        assert zero.wait() == 2, zero.log
    finally:
        stop_all([zero, peer])
    for log in (peer.log, zero.log):
        error = one_paragraph_error(log)
        assert f"source {this_build().source}" in error and "same build" in error
    assert error.count("(source ") == 2


def test_a_peer_that_dies_ends_every_rank_with_its_name(hosts, monkeypatch):
    import time

    monkeypatch.setenv("HOME", str(hosts(0)))
    entry = export_ranks(hosts(0), 4)
    address = rendezvous()
    trust = approval(dev_fingerprint(hosts(0)))
    zero = RankProcess(hosts(0), str(entry), "--rank", "0", "--rendezvous", address, "--stage-only", *trust)
    one = RankProcess(hosts(1), "--rank", "1", "--rendezvous", address, *trust)
    two = RankProcess(hosts(2), "--rank", "2", "--rendezvous", address, *trust)
    try:
        zero.wait_for("rank 1 staged")
        zero.wait_for("rank 2 staged")                  # rank 3 never comes: the launch waits for it
        one.kill()
        died = time.monotonic()
        assert zero.wait(timeout=30) != 0
        assert two.wait(timeout=30) != 0
        assert time.monotonic() - died < 30
    finally:
        stop_all([zero, one, two])
    for log in (zero.log, two.log):
        error = one_paragraph_error(log)
        assert "rank 1 (127.0.0.1:" in error and "closed its connection" in error


def test_rank_zero_that_dies_ends_its_peers(hosts, monkeypatch):
    monkeypatch.setenv("HOME", str(hosts(0)))
    entry = export_ranks(hosts(0), 3)
    address = rendezvous()
    trust = approval(dev_fingerprint(hosts(0)))
    zero = RankProcess(hosts(0), str(entry), "--rank", "0", "--rendezvous", address, "--stage-only", *trust)
    one = RankProcess(hosts(1), "--rank", "1", "--rendezvous", address, *trust)
    try:
        zero.wait_for("rank 1 staged")
        zero.kill()
        assert one.wait(timeout=30) == 1
    finally:
        stop_all([zero, one])
    error = one_paragraph_error(one.log)
    assert f"rank zero at {address}" in error and "closed its connection" in error


def test_a_peer_given_another_export_is_refused_with_the_reason(hosts, monkeypatch):
    monkeypatch.setenv("HOME", str(hosts(0)))
    entry = export_ranks(hosts(0), 2)
    monkeypatch.setenv("HOME", str(hosts(1)))
    other = export_ranks(hosts(1), 2)                    # the same model, exported again on the peer
    address = rendezvous()
    trust = approval(dev_fingerprint(hosts(0)))
    zero = RankProcess(hosts(0), str(entry), "--rank", "0", "--rendezvous", address, "--stage-only", *trust)
    peer = RankProcess(hosts(1), str(other), "--rank", "1", "--rendezvous", address, *trust)
    try:
        assert peer.wait() == 2 and zero.wait() == 2
    finally:
        stop_all([zero, peer])
    error = one_paragraph_error(peer.log)
    assert f"stories260k@{other.name}" in error and f"rank zero serves stories260k@{entry.name}" in error
    assert "rank 1 failed" in one_paragraph_error(zero.log)


def test_too_little_space_under_a_ranks_cache_is_refused_before_copying(tmp_path, monkeypatch):
    from flare.errors import CapacityError
    from flare.hosts import distribution
    from flare.package.manifest import PayloadRecord
    from flare.package.store import ModelCache

    cache = ModelCache(tmp_path / "cache")
    records = (PayloadRecord("weights/layer-000.safetensors", "weights", "a" * 64, 3 << 30),
               PayloadRecord("weights/layer-001.safetensors", "weights", "b" * 64, 2 << 30))
    receipt = distribution.plan_receipt(cache, records)
    monkeypatch.setattr(distribution, "free_bytes", lambda path: 4 << 30)
    with pytest.raises(CapacityError) as refused:
        distribution.check_space(cache, receipt, 3)
    assert str(refused.value).startswith(f"4.0 GiB free under {cache.root}; this launch stores 5.0 GiB there")
    assert "--model-cache PATH" in str(refused.value)
    assert not cache.root.exists()                      # nothing was written


def test_serving_without_stage_only_is_refused_by_name_before_waiting(hosts, monkeypatch):
    monkeypatch.setenv("HOME", str(hosts(0)))
    entry = export_ranks(hosts(0), 2)
    zero = RankProcess(hosts(0), str(entry), "--rank", "0", "--rendezvous", rendezvous(),
                       *approval(dev_fingerprint(hosts(0))))
    assert zero.wait(timeout=60) == 2
    assert "--stage-only" in one_paragraph_error(zero.log)


@pytest.mark.parametrize("args, expected", [
    (("--rank", "1"), "--rank needs --rendezvous"),
    (("--rendezvous", "127.0.0.1:1"), "--rendezvous needs --rank"),
    (("--rank", "0", "--rendezvous", ":29800"), "rank zero needs PACKAGE"),
    (("--rank", "1", "--rendezvous", ":29800"), "names no host"),
    (("--rank", "1", "--rendezvous", "127.0.0.1:1", "--stage-only"), "--stage-only is rank zero's setting"),
    (("pkg", "--rank", "0", "--rendezvous", "127.0.0.1:1", "--transfer-streams", "65"), "outside 1-64"),
    (("pkg", "--stage-only"), "add --rank 0"),
    (("--rank", "1", "--rendezvous", "127.0.0.1:99999"), "outside 1-65535"),
])
def test_rank_flags_are_checked_with_a_usage_error(args, expected):
    from tests.server.conftest import cli_command
    import subprocess

    done = subprocess.run(cli_command("flare", "run", *args), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert expected in done.stderr and "Traceback" not in done.stderr
