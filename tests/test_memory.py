"""Memory limits, GPU selection, device memory and KV pool sizing (spec "Runtime memory limits", §4)."""

from __future__ import annotations

import sys
import types

import pytest

from flare.errors import CapacityError, UsageError
from flare.estimate import size_kv_pool
from flare.memory import (GiB, MiB, DeviceMemory, FixedCosts, KVGeometry, check_gpu_selection, engine_headroom,
                          format_gpus, memory_budget, parse_gpus, parse_memory_limit, parse_size,
                          read_device_memory, read_host_memory)


@pytest.mark.parametrize("text,expected", [
    ("30G", 30 * GiB), ("30g", 30 * GiB), ("30GB", 30 * GiB), ("30gb", 30 * GiB), ("30GiB", 30 * GiB),
    ("30gib", 30 * GiB), ("512M", 512 * MiB), ("1.5G", 3 * GiB // 2), ("2T", 2048 * GiB), ("64k", 64 << 10),
])
def test_sizes_use_binary_units_in_any_case(text, expected):
    assert parse_size(text, "size") == expected


def test_memory_limit_forms():
    assert parse_memory_limit("30G").kind == "occupied"
    assert parse_memory_limit("30G").size == 30 * GiB
    reserve = parse_memory_limit("-30g")
    assert (reserve.kind, reserve.size) == ("reserve", 30 * GiB)
    assert parse_memory_limit("-0G").size == 0
    fraction = parse_memory_limit("0.8")
    assert (fraction.kind, fraction.fraction) == ("fraction", 0.8)
    assert fraction.occupied_cap(100 * GiB) == 80 * GiB
    assert parse_memory_limit("1").fraction == 1.0


@pytest.mark.parametrize("text,complaint", [
    ("0", "greater than 0"), ("0G", "zero"), ("-0.5", "negative"), ("1.5", "at most 1"),
    ("30", "sizes need a unit"), ("-30", "negative"), ("nan", "greater than 0"), ("inf", "greater than 0"),
    ("-inf", "negative"), ("1e400G", "too large"), ("99999999999T", "too large"), ("lots", "not a size"),
    ("", "not a size"), ("30X", "not a size"),
])
def test_memory_limit_rejections_say_what_is_wrong(text, complaint):
    with pytest.raises(UsageError, match=complaint) as caught:
        parse_memory_limit(text)
    assert "--memory-limit" in str(caught.value)


def test_reserve_accepts_bare_zero_and_sizes_only():
    assert parse_size("0", "[memory] reserve") == 0
    assert parse_size("12G", "[memory] reserve") == 12 * GiB
    with pytest.raises(UsageError, match=r"\[memory\] reserve"):
        parse_size("12", "[memory] reserve")


@pytest.mark.parametrize("text,expected", [
    ("0", (0,)), ("0,1", (0, 1)), ("0-3", (0, 1, 2, 3)), ("0,2-3", (0, 2, 3)), (" 1 , 3", (1, 3)),
])
def test_gpu_lists(text, expected):
    assert parse_gpus(text) == expected


@pytest.mark.parametrize("text", ["", "a", "-1", "1-0", "0,0", "0-2,1", "0;1"])
def test_bad_gpu_lists_are_usage_errors(text):
    with pytest.raises(UsageError, match="--gpus"):
        parse_gpus(text)


def test_gpu_lists_format_back_to_their_shortest_form():
    assert format_gpus((0, 1)) == "0-1"
    assert format_gpus((0, 1, 2, 3)) == "0-3"
    assert format_gpus((0, 2)) == "0,2"
    assert parse_gpus(format_gpus((1, 2, 3))) == (1, 2, 3)


def test_gpu_index_counts_within_cuda_visible_devices(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5")
    check_gpu_selection((0, 1), visible_count=2)
    with pytest.raises(UsageError, match="CUDA_VISIBLE_DEVICES=4,5"):
        check_gpu_selection((2,), visible_count=2)


def test_nvml_devices_follow_cuda_visible_devices(monkeypatch):
    """Index entries and UUID entries of CUDA_VISIBLE_DEVICES both name NVML devices, in that order."""
    class NVMLError(Exception):
        pass

    names = {0: "gpu-zero", 3: "gpu-three", "GPU-1234": "gpu-by-uuid"}
    fake = types.SimpleNamespace(
        NVMLError=NVMLError, nvmlInit=lambda: None, nvmlShutdown=lambda: None,
        nvmlDeviceGetCount=lambda: 4,
        nvmlDeviceGetHandleByIndex=lambda index: index,
        nvmlDeviceGetHandleByUUID=lambda uuid: uuid,
        nvmlDeviceGetName=lambda handle: names.get(handle, f"gpu-{handle}"),
        nvmlDeviceGetMemoryInfo=lambda handle: types.SimpleNamespace(free=10 * GiB, total=80 * GiB),
    )
    monkeypatch.setitem(sys.modules, "pynvml", fake)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3,GPU-1234")
    devices = read_device_memory()
    assert [(device.index, device.name) for device in devices] == [(0, "gpu-three"), (1, "gpu-by-uuid")]
    assert devices[0].free == 10 * GiB and not devices[0].host
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    assert [device.name for device in read_device_memory()] == ["gpu-zero", "gpu-1", "gpu-2", "gpu-three"]


def test_without_a_gpu_memory_is_sized_against_the_host(monkeypatch, tmp_path):
    class NVMLError(Exception):
        pass

    def no_driver():
        raise NVMLError("driver not loaded")

    monkeypatch.setitem(sys.modules, "pynvml", types.SimpleNamespace(NVMLError=NVMLError, nvmlInit=no_driver))
    devices = read_device_memory()
    assert len(devices) == 1 and devices[0].host
    assert 0 < devices[0].free <= devices[0].total
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       16384000 kB\nMemFree:         1000 kB\nMemAvailable:    8192000 kB\n")
    host = read_host_memory(meminfo)
    assert (host.total, host.free) == (16384000 * 1024, 8192000 * 1024)


def test_engine_headroom():
    assert engine_headroom("preparation", prefill_tokens=4096) == GiB
    assert engine_headroom("preparation", prefill_tokens=8192) == GiB + 4096 * 128 * 1024
    assert engine_headroom("serving") == 2 * GiB


DEVICE = DeviceMemory(index=0, name="test gpu", free=60 * GiB, total=80 * GiB)


def test_budget_forms():
    assert memory_budget(DEVICE, headroom=GiB, reserve=10 * GiB).available == 49 * GiB
    flag_reserve = memory_budget(DEVICE, GiB, parse_memory_limit("-5G"), reserve=10 * GiB)
    assert flag_reserve.available == 54 * GiB                     # the flag replaces the configured reserve
    assert memory_budget(DEVICE, GiB, parse_memory_limit("30G"), reserve=10 * GiB).available == 29 * GiB
    assert memory_budget(DEVICE, GiB, parse_memory_limit("70G")).available == 59 * GiB   # supply still binds
    assert memory_budget(DEVICE, GiB, parse_memory_limit("0.5")).available == 39 * GiB   # of total, not free


FIXED = FixedCosts(weights=20 * GiB, graphs=2 * GiB, live_state=GiB // 2, prefix_cache_floor=GiB // 2)
# 128 KiB per token (e.g. 32 layers x 8 KV heads x 128 x 2 x bf16): a 16-token page is 2 MiB.
GEOMETRY = KVGeometry(page_size=16, bytes_per_token=128 * 1024, max_context=32768, max_concurrency=4)


def test_kv_pages_take_the_rest_of_memory():
    budget = memory_budget(DEVICE, headroom=GiB, reserve=10 * GiB)
    pool = size_kv_pool(budget, FIXED, GEOMETRY)
    assert pool.limited_by == "memory"
    assert pool.pages == (49 - 23) * GiB // (2 * MiB)
    assert pool.tokens == pool.pages * 16
    assert "limited by memory" in pool.describe()


def test_kv_cache_limit_ceilings():
    budget = memory_budget(DEVICE, headroom=GiB)
    context = size_kv_pool(budget, FIXED, GEOMETRY, "context")
    assert (context.pages, context.limited_by) == (32768 // 16, "context ceiling")
    concurrency = size_kv_pool(budget, FIXED, GEOMETRY, "concurrency")
    assert (concurrency.pages, concurrency.limited_by) == (4 * 32768 // 16, "concurrency ceiling")
    small = memory_budget(DEVICE, headroom=GiB, reserve=35 * GiB)      # 1 GiB left for pages: 512 pages
    assert size_kv_pool(small, FIXED, GEOMETRY, "context").limited_by == "memory"


def test_a_pool_below_its_minimum_fails_in_section_6_form():
    # 1 GiB for pages: 512 pages, below 4 x 8,192 tokens (2,048 pages), enough for one request's 8,192.
    budget = memory_budget(DEVICE, headroom=GiB, reserve=35 * GiB)
    with pytest.raises(CapacityError) as caught:
        size_kv_pool(budget, FIXED, GEOMETRY)
    message = str(caught.value)
    assert message.startswith("needs 20.0 GiB weights + 2.0 GiB graphs + 0.5 GiB live state + 0.5 GiB prefix")
    assert "minimum pages (4 × 8,192 tokens)" in message
    assert "has 60.0 GiB free − 1.0 GiB headroom − 35.0 GiB reserve = 24.0 GiB." in message
    assert 'Options: [memory] reserve = "32G"; --max-concurrency 1; --kv-cache-limit concurrency.' in message
    # Each option fits on its own.
    size_kv_pool(memory_budget(DEVICE, GiB, reserve=parse_size("32G", "[memory] reserve")), FIXED, GEOMETRY)
    size_kv_pool(budget, FIXED, KVGeometry(16, 128 * 1024, 32768, max_concurrency=1))
    assert size_kv_pool(budget, FIXED, GEOMETRY, "concurrency").pages == 512
    assert CapacityError.exit_code == 4


def test_a_capped_pool_needs_only_a_page_per_request():
    budget = memory_budget(DEVICE, headroom=GiB, reserve=36 * GiB - 4 * 2 * MiB)   # room for 4 pages
    assert size_kv_pool(budget, FIXED, GEOMETRY, "context").pages == 4
    tighter = memory_budget(DEVICE, headroom=GiB, reserve=36 * GiB - 3 * 2 * MiB)
    with pytest.raises(CapacityError, match=r"minimum pages \(4 × 16 tokens\)"):
        size_kv_pool(tighter, FIXED, GEOMETRY, "context")
