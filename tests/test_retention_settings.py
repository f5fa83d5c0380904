"""`flare run`'s prefix retention settings: [prefix_cache], [paths] prefix_cache and the pool flags, checked
before anything loads (spec §3.3, §3.4)."""

from __future__ import annotations

import shutil

import pytest

from flare.config import load_config
from flare.engine.retention.pool_address import PoolAddress, check_pool_ca, parse_pool_address
from flare.engine.stats import EngineStats
from flare.errors import CapacityError, UsageError
from flare.memory import DeviceMemory
from flare.server import retention_settings
from flare.server.retention_settings import PoolFlags, retention_lines, serving_retention

IDENTITY = "0f" * 32


def config(tmp_path, text: str):
    path = tmp_path / "config.toml"
    path.write_text(text)
    return load_config(path)


@pytest.fixture(autouse=True)
def roomy_host(monkeypatch):
    monkeypatch.setattr(retention_settings, "read_host_memory",
                        lambda: DeviceMemory(0, "host memory", free=64 << 30, total=128 << 30, host=True))


def test_nothing_configured_retains_nothing(tmp_path):
    settings = serving_retention(config(tmp_path, ""), IDENTITY)
    assert not settings.enabled and settings.disk is None and settings.pool is None
    assert "GPU pages only" in retention_lines(settings)[0]


def test_memory_and_a_directory_make_the_host_and_disk_tiers(tmp_path):
    directory = tmp_path / "prefixes"
    settings = serving_retention(config(tmp_path, f'[prefix_cache]\nmemory = "4G"\ndrain_on_shutdown = "on"\n'
                                                  f'[paths]\nprefix_cache = "{directory}"\n'), IDENTITY)
    assert settings.host_bytes == 4 << 30 and settings.identity == IDENTITY
    disk = settings.disk
    assert disk.directory == str(directory) and disk.transport == "staged" and disk.drain_s == 30.0
    free = shutil.disk_usage(directory).free
    assert abs(disk.limit_bytes - free // 10) < free // 1000      # the default: 10% of the free space
    report = "\n".join(retention_lines(settings))
    assert "4.0 GiB of host memory" in report and str(directory) in report and "staged" in report
    found = EngineStats(0, 0, 0, 100, 0, retained_host_slots=2048, retained_disk_pages=1500,
                        retained_disk_bytes=3 << 30)
    report = "\n".join(retention_lines(settings, found))
    assert "4.0 GiB of host memory (2,048 pages)" in report
    assert "the disk holds 1,500 pages (3.0 GiB) from earlier runs" in report


@pytest.mark.parametrize("text,named", [
    ('[paths]\nprefix_cache = "{dir}"\n', r"\[prefix_cache\] memory"),
    ('[prefix_cache]\nmemory = "1G"\ndisk_limit = "10G"\n', "disk_limit"),
    ('[prefix_cache]\nmemory = "1G"\ndisk_transport = "direct"\n', "disk_transport"),
    ('[prefix_cache]\nmemory = "1G"\ndrain_on_shutdown = "10s"\n', "drain_on_shutdown"),
])
def test_a_tier_without_what_it_needs_is_refused_by_name(tmp_path, text, named):
    with pytest.raises(UsageError, match=named) as caught:
        serving_retention(config(tmp_path, text.format(dir=tmp_path / "p")), IDENTITY)
    assert str(tmp_path / "config.toml") in str(caught.value)


def test_the_pool_needs_host_memory(tmp_path):
    with pytest.raises(UsageError, match=r"--prefix-cache-pool .*\[prefix_cache\] memory"):
        serving_retention(config(tmp_path, ""), IDENTITY, PoolFlags("unix:/tmp/pool.sock"))
    settings = serving_retention(config(tmp_path, '[prefix_cache]\nmemory = "1G"\n'), IDENTITY,
                                 PoolFlags("unix:/tmp/pool.sock"))
    assert settings.pool.address == "unix:/tmp/pool.sock" and settings.disk is None


def test_more_host_memory_than_the_host_has_is_a_capacity_error(tmp_path):
    with pytest.raises(CapacityError) as caught:
        serving_retention(config(tmp_path, '[prefix_cache]\nmemory = "100G"\n'), IDENTITY)
    text = str(caught.value)
    assert "needs 100.0 GiB of host memory; has 64.0 GiB available" in text
    assert 'Options: [prefix_cache] memory = "57G"' in text and caught.value.exit_code == 4


def test_direct_transport_is_refused_where_the_file_system_refuses_o_direct(tmp_path, monkeypatch):
    from flare.engine.retention import disk_store

    monkeypatch.setattr(disk_store, "check_direct_io", lambda directory: "the file system refuses O_DIRECT")
    with pytest.raises(UsageError, match=r'disk_transport = "direct".*refuses O_DIRECT.*"staged"'):
        serving_retention(config(tmp_path, f'[prefix_cache]\nmemory = "1G"\ndisk_transport = "direct"\n'
                                           f'[paths]\nprefix_cache = "{tmp_path / "p"}"\n'), IDENTITY)


@pytest.mark.parametrize("text,address", [
    ("unix:/run/flare/pool.sock", PoolAddress("unix", path="/run/flare/pool.sock")),
    ("127.0.0.1:7000", PoolAddress("tcp", host="127.0.0.1", port=7000)),
    ("pool.example.org:65535", PoolAddress("tcp", host="pool.example.org", port=65535)),
    ("tls:pool.example.org:7000", PoolAddress("tls", host="pool.example.org", port=7000)),
    ("[::1]:7000", PoolAddress("tcp", host="::1", port=7000)),
    ("tls:[::1]:7000", PoolAddress("tls", host="::1", port=7000)),
])
def test_pool_addresses(text, address):
    assert parse_pool_address(text) == address
    assert str(address) == text


@pytest.mark.parametrize("text,reason", [
    ("unix:", "no socket path"), (":7000", "empty host"), ("tls::7000", "empty host"),
    ("example.org", "no port"), ("example.org:0", "1 through 65535"), ("example.org:65536", "1 through 65535"),
    ("example.org:http", "1 through 65535"), ("::1:7000", "brackets"), ("[::1]7000", "brackets"),
    ("tls:[::1]", "brackets"),
])
def test_bad_pool_addresses_are_refused_with_what_to_write(text, reason):
    with pytest.raises(UsageError, match=reason) as caught:
        parse_pool_address(text)
    assert "--prefix-cache-pool" in str(caught.value)


def test_the_ca_goes_with_a_tls_pool_only(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("not a certificate")
    with pytest.raises(UsageError, match="needs --prefix-cache-pool"):
        check_pool_ca(None, ca)
    for plain in ("unix:/tmp/pool.sock", "127.0.0.1:7000"):
        with pytest.raises(UsageError, match="only a tls:HOST:PORT address checks a CA"):
            check_pool_ca(parse_pool_address(plain), ca)
    with pytest.raises(UsageError, match="not a CA file"):
        check_pool_ca(parse_pool_address("tls:127.0.0.1:7000"), ca)
