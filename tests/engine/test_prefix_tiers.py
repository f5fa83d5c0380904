"""Prefix states below the GPU: pages evicted from the GPU prefix cache are kept in host slots (and on disk),
found by the same chained page hashes, and copied back for a request that repeats the prefix.

The fake runner checks content: it writes each token into its fake KV at the page's slot, copies page
contents to and from its host slots and disk as the plans say, and raises when a row's context read back
from the pages is not the request's tokens. So a restored page with the wrong content fails the test."""

from __future__ import annotations

import pytest
from fake_runner import FakeRunner, fake_continuation
from test_scheduler import add, prompt, run_to_end

from flare.engine.config import EngineConfig
from flare.engine.core import EngineCore
from flare.engine.retention.settings import DiskRetention, RetentionSettings

IDENTITY = "ab" * 32


def retaining_core(slots: int = 64, lag: int = 0, disk_limit: int | None = None, runner=None, drain_s: float = 0.0,
                   **settings) -> EngineCore:
    disk = DiskRetention("/unused", disk_limit, drain_s=drain_s) if disk_limit is not None else None
    retention = RetentionSettings(host_bytes=slots, identity=IDENTITY, disk=disk)
    config = EngineConfig(**{"page_size": 4, "num_pages": 16, "max_model_len": 48, "max_concurrency": 2,
                             "prefill_chunk": 16, "max_num_batched_tokens": 32, **settings},
                          prefix_retention=retention)
    return EngineCore(config, runner or FakeRunner(config.page_size, slots, lag), eos_token_ids=())


def outputs(core: EngineCore, request_id: str, ids: list[int], max_tokens: int = 4):
    add(core, request_id, ids, max_tokens=max_tokens)
    found = {}
    for _ in range(1000):
        if not core.has_unfinished():
            return found[request_id]
        for output in core.step():
            found.setdefault(output.request_id, []).append(output)
        core.check_integrity()
    raise AssertionError("the engine did not finish")


def evict_everything(core: EngineCore, count: int = 3) -> None:
    for i in range(count):
        outputs(core, f"filler-{i}", prompt(40, 50 + i), max_tokens=4)
    assert core.stats().prefix_cache_evicted_pages > 0


def test_pages_evicted_from_the_gpu_come_back_from_the_host():
    core = retaining_core()
    first = outputs(core, "a", prompt(33), max_tokens=4)
    evict_everything(core)
    assert core.allocator.match_prefix("probe", prompt(33), 32) == 0       # nothing of it on the GPU
    core.allocator.free("probe")
    again = outputs(core, "a-again", prompt(33), max_tokens=4)
    tokens = [t for o in again for t in o.new_token_ids]
    assert tokens == fake_continuation(prompt(33), 4) == [t for o in first for t in o.new_token_ids]
    assert again[0].num_cached_tokens == 32                 # every full page but the last token's
    stats = core.stats()
    assert stats.prefix_cache_host_hit_tokens == 32
    assert stats.retained_bytes_host_to_gpu == 8            # the fake's page is one byte
    assert stats.prefix_cache_hit_tokens >= 32


def test_a_request_waiting_for_its_pages_holds_up_nobody():
    core = retaining_core(lag=5, max_concurrency=3, num_pages=24)
    outputs(core, "a", prompt(33), max_tokens=2)
    evict_everything(core)
    add(core, "long", prompt(6, 3), max_tokens=12)
    core.step()
    add(core, "a-again", prompt(33), max_tokens=2)
    waited = 0
    tokens = {}
    while core.has_unfinished():
        if "a-again" in core.scheduler.fetching:
            waited += 1
            assert any(r.request_id == "long" for r in core.scheduler.running)
        for output in core.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
        core.check_integrity()
    assert waited >= 5                                     # the load's news came late, and "long" ran on
    assert tokens["a-again"] == fake_continuation(prompt(33), 2)
    assert tokens["long"][-1] == fake_continuation(prompt(6, 3), 12)[-1]


def test_a_request_aborted_while_its_pages_load_leaves_the_books_clean():
    core = retaining_core(lag=3)
    outputs(core, "a", prompt(33), max_tokens=2)
    evict_everything(core)
    add(core, "a-again", prompt(33), max_tokens=2)
    core.step()
    assert "a-again" in core.scheduler.fetching
    core.abort(["a-again"])
    for _ in range(6):
        core.step()
    core.check_integrity()
    assert core.allocator.num_used_pages == 0 and not core.has_unfinished()
    assert outputs(core, "b", prompt(33), max_tokens=2)[-1].finish_reason == "length"


def test_a_small_host_tier_writes_down_to_disk_and_reads_back():
    runner = FakeRunner(4, retained_slots=8)
    core = retaining_core(slots=8, disk_limit=1000, runner=runner)
    outputs(core, "a", prompt(33), max_tokens=2)
    evict_everything(core, 4)                              # the host's 8 slots hold fewer than the pages saved
    assert core.stats().retained_disk_pages > 8
    again = outputs(core, "a-again", prompt(33), max_tokens=2)
    assert [t for o in again for t in o.new_token_ids] == fake_continuation(prompt(33), 2)
    stats = core.stats()
    assert stats.prefix_cache_disk_hit_tokens > 0
    assert stats.prefix_cache_disk_hit_tokens + stats.prefix_cache_host_hit_tokens == again[0].num_cached_tokens == 32


def test_a_damaged_disk_page_is_recomputed_from_where_it_is():
    runner = FakeRunner(4, retained_slots=8)
    core = retaining_core(slots=8, disk_limit=1000, runner=runner)
    outputs(core, "a", prompt(33), max_tokens=2)
    evict_everything(core, 4)
    keys = core.allocator.content_hashes("probe", prompt(33), 0, 8)
    core.allocator.free("probe")
    assert all(key in runner.retention.disk and key not in core.tiers.host for key in keys)
    runner.retention.damaged.add(keys[2])
    again = outputs(core, "a-again", prompt(33), max_tokens=2)
    assert [t for o in again for t in o.new_token_ids] == fake_continuation(prompt(33), 2)
    assert again[0].num_cached_tokens == 8                 # pages 0 and 1; from the damaged one on, computed
    assert core.stats().retained_read_failures == 1


def test_a_full_disk_is_noted_and_serving_goes_on():
    runner = FakeRunner(4, retained_slots=8)
    runner.retention.unwritable = True
    core = retaining_core(slots=8, disk_limit=1000, runner=runner)
    outputs(core, "a", prompt(33), max_tokens=2)
    evict_everything(core, 4)
    stats = core.stats()
    assert stats.retained_write_failures > 0 and stats.retained_disk_pages == 0
    assert core.tiers.disk.limit_entries == 0              # it stops trying: the disk holds no more than it has
    again = outputs(core, "a-again", prompt(33), max_tokens=2)
    assert [t for o in again for t in o.new_token_ids] == fake_continuation(prompt(33), 2)


@pytest.mark.parametrize("slots,lag", [(3, 0), (4, 1), (6, 2)])
def test_tiers_under_pressure_never_change_an_answer(slots, lag):
    # Fifteen requests over three shared prefixes, a GPU pool of about three of them and a small host tier
    # over a small disk, news coming late: pages are saved, loaded, written, read, evicted and requests
    # preempted all the time. The fake raises on a page whose content is not its request's tokens.
    runner = FakeRunner(4, retained_slots=slots, lag=lag)
    core = retaining_core(slots=slots, disk_limit=24, runner=runner, num_pages=14, max_model_len=56,
                          max_concurrency=4, prefill_chunk=8, max_num_batched_tokens=16)
    systems = [prompt(12, 1), prompt(16, 2), prompt(20, 3)]
    prompts = {f"r{i}": systems[i % 3] + prompt(3 + i % 5, 40 + i) for i in range(15)}
    for i, (request_id, ids) in enumerate(prompts.items()):
        add(core, request_id, ids, max_tokens=6 + i % 7)
    tokens = run_to_end(core)
    for i, (request_id, ids) in enumerate(prompts.items()):
        assert tokens[request_id] == fake_continuation(ids, 6 + i % 7)
    stats = core.stats()
    assert stats.prefix_cache_host_hit_tokens > 0 and stats.prefix_cache_disk_hit_tokens > 0
    assert stats.num_preemptions > 0 and stats.kv_pages_used == 0


@pytest.mark.parametrize("drain", [True, False])
def test_a_clean_stop_drains_the_host_tier_to_disk(monkeypatch, drain):
    from flare.engine.retention import tiers

    monkeypatch.setattr(tiers, "WRITES_IN_FLIGHT", 0)      # nothing is written down while serving
    runner = FakeRunner(4, retained_slots=64)
    core = retaining_core(disk_limit=1000, runner=runner, drain_s=5.0)
    outputs(core, "a", prompt(33), max_tokens=2)
    assert runner.retention.disk == {}
    core.close(drain=drain)
    keys = set(core.allocator.content_hashes("probe", prompt(33), 0, 8))
    assert (keys <= set(runner.retention.disk)) == drain
