"""Runtime limits: --max-concurrency within the prepared capacity, --kv-cache-limit through startup sizing."""

from __future__ import annotations

import pytest
from fake_runner import FakeRunner, fake_continuation
from test_scheduler import add, prompt, run_to_end

from flare.engine.config import EngineConfig, engine_config_for_pool
from flare.engine.core import EngineCore
from flare.engine.request import InvalidRequest
from flare.engine.policy import SchedulerPolicy
from flare.errors import UsageError
from flare.estimate import size_kv_pool
from flare.memory import GiB, MiB, DeviceMemory, FixedCosts, KVGeometry, memory_budget

DEVICE = DeviceMemory(index=0, name="test GPU", free=60 * GiB, total=80 * GiB)
FIXED = FixedCosts(weights=20 * GiB, graphs=2 * GiB, live_state=GiB // 2, prefix_cache_floor=GiB // 2)
PAGE_BYTES = 2 * MiB                               # 16 tokens of 128 KiB


def geometry(context: int = 1000, concurrency: int = 3) -> KVGeometry:
    return KVGeometry(page_size=16, bytes_per_token=128 * 1024, max_context=context, max_concurrency=concurrency)


def startup_config(kv_cache_limit: str, reserve: int = 0, context: int = 1000, concurrency: int = 3) -> EngineConfig:
    """What serving startup does: size the pool on the device, then build the engine's config from it."""
    pool = size_kv_pool(memory_budget(DEVICE, headroom=GiB, reserve=reserve), FIXED,
                        geometry(context, concurrency), kv_cache_limit)
    return engine_config_for_pool(pool, max_concurrency=concurrency, prepared_context=context, prefill_chunk=256,
                                  prepared_concurrency=4)


def test_memory_mode_takes_every_page_memory_gives():
    config = startup_config("memory")
    assert config.kv_pool_limited_by == "memory"
    assert config.num_pages == (59 - 23) * GiB // PAGE_BYTES
    assert config.max_model_len == 1000


def test_context_mode_caps_the_pool_at_one_context_rounded_up_to_pages():
    config = startup_config("context")
    assert (config.kv_pool_limited_by, config.num_pages) == ("context", 63)      # 1,000 tokens: 63 pages
    assert config.max_concurrency == 3 and config.max_model_len == 1000        # shorter requests share it


def test_concurrency_mode_caps_the_pool_at_a_context_per_selected_request():
    config = startup_config("concurrency")          # three requests, even where graphs use a batch-four bucket
    assert (config.kv_pool_limited_by, config.num_pages) == ("concurrency", 3 * 63)


def test_a_ceiling_above_what_memory_gives_reports_memory_and_serves_a_shorter_context():
    # 36 GiB reserved leaves 0.25 GiB for pages: 128 pages, less than one 4,096-token context.
    config = startup_config("context", reserve=36 * GiB - GiB // 4, context=4096, concurrency=2)
    assert (config.kv_pool_limited_by, config.num_pages) == ("memory", 128)
    assert config.max_model_len == 128 * 16           # the served context fits the pool it got


def test_a_capped_pool_serves_one_request_of_the_full_context_beside_others():
    pool = size_kv_pool(memory_budget(DEVICE, headroom=GiB), FIXED,
                        KVGeometry(page_size=4, bytes_per_token=1024, max_context=64, max_concurrency=3), "context")
    config = engine_config_for_pool(pool, max_concurrency=3, prepared_context=64, prefill_chunk=16)
    core = EngineCore(config, FakeRunner(config.page_size))
    add(core, "long", prompt(40), max_tokens=23)     # 63 tokens: the whole context
    add(core, "short-a", prompt(6, 1), max_tokens=8)
    add(core, "short-b", prompt(6, 2), max_tokens=8)
    tokens = run_to_end(core)
    assert tokens["long"] == fake_continuation(prompt(40), 23)
    assert tokens["short-b"] == fake_continuation(prompt(6, 2), 8)
    with pytest.raises(InvalidRequest, match="at most 64"):
        add(core, "too-long", prompt(64), max_tokens=1)


def test_max_concurrency_reduces_within_the_prepared_capacity():
    assert EngineConfig(max_concurrency=3, prepared_concurrency=4).max_concurrency == 3
    assert EngineConfig(max_concurrency=4, prepared_concurrency=4).max_concurrency == 4
    with pytest.raises(UsageError, match="--max-concurrency 6 exceeds the package's prepared concurrency 4"):
        EngineConfig(max_concurrency=6, prepared_concurrency=4)
    with pytest.raises(UsageError, match="--max-concurrency 6 exceeds the package's prepared concurrency 4"):
        engine_config_for_pool(size_kv_pool(memory_budget(DEVICE, headroom=GiB), FIXED, geometry(), "context"),
                               max_concurrency=6, prepared_context=1000, prefill_chunk=256, prepared_concurrency=4)


def test_the_engine_runs_no_more_requests_than_the_selected_concurrency():
    config = EngineConfig(max_concurrency=2, prepared_concurrency=8, page_size=4, num_pages=64, max_model_len=64)
    core = EngineCore(config, FakeRunner(config.page_size))
    for i in range(5):
        add(core, f"r{i}", prompt(5, i), max_tokens=6)
    run_to_end(core)
    assert max(len(s.rows) for s in core.runner.steps) == 2


def test_the_policy_travels_in_the_engine_config():
    policy = SchedulerPolicy("throughput", terminal_value=0, terminal_age_price=3)
    pool = size_kv_pool(memory_budget(DEVICE, headroom=GiB), FIXED, geometry(), "context")
    config = engine_config_for_pool(pool, max_concurrency=3, prepared_context=1000, prefill_chunk=256,
                                    scheduler_policy=policy)
    assert EngineCore(config, FakeRunner(config.page_size)).scheduler.policy == policy
    assert EngineConfig().scheduler_policy == SchedulerPolicy("balanced", 256, 1)
