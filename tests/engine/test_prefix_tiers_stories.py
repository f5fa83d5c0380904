"""Prefix states below the GPU on a real model (stories260k on the CPU): the K/V restored from the host tier
or from disk gives the tokens recomputing it gives; states on disk survive a restart of the engine, and a
damaged, foreign or unwritable file is noted and never served."""

from __future__ import annotations

import errno

import pytest

from flare.engine.config import EngineConfig
from flare.engine.retention.disk_store import DiskStore
from flare.engine.retention.settings import DiskRetention, RetentionSettings
from flare.engine.sampling_params import SamplingParams
from flare.engine_client.llm_engine import LLMEngine

GREEDY = SamplingParams(temperature=0, max_tokens=8)
STORY = "Once upon a time there was a little girl named Lily. She liked to play outside in the park"
IDENTITY = "1d" * 32


@pytest.fixture
def engine(stories260k, checked):
    made = []

    def make(retention: RetentionSettings | None = None, **settings) -> LLMEngine:
        config = EngineConfig(**{"page_size": 4, "num_pages": 40, "max_model_len": 128, "max_concurrency": 2,
                                 **settings}, prefix_retention=retention or RetentionSettings())
        llm = checked(LLMEngine.from_checkpoint(stories260k, config))
        made.append(llm)
        return llm

    yield make
    for llm in made:
        llm.core.close(drain=False)


def disk_retention(directory, identity: str = IDENTITY, **disk) -> RetentionSettings:
    return RetentionSettings(host_bytes=1 << 20, identity=identity,
                             disk=DiskRetention(str(directory), **{"limit_bytes": 1 << 30, **disk}))


def on_the_gpu(llm: LLMEngine, ids: list[int]) -> int:
    """Tokens of `ids`' prefix the GPU prefix cache holds."""
    allocator = llm.core.allocator
    keys = allocator.content_hashes("probe", ids, 0, (len(ids) - 1) // allocator.page_size)
    allocator.free("probe")
    return sum(allocator.caches(key) for key in keys) * allocator.page_size


def evict(llm: LLMEngine, ids: list[int]) -> None:
    """Unrelated prompts until no page of `ids` is left on the GPU."""
    for i in range(20):
        if on_the_gpu(llm, ids) == 0:
            return
        llm.generate([llm.tokenizer.encode(f"Tom had a big dog number {i} and the dog was happy and ran far")], GREEDY)
    raise AssertionError("the prefix stayed on the GPU")


@pytest.fixture(scope="module")
def recomputed(stories260k):
    """The story's greedy tokens without any cache."""
    llm = LLMEngine.from_checkpoint(stories260k, EngineConfig(page_size=4, num_pages=40, max_model_len=128,
                                                              enable_prefix_caching=False))
    ids = llm.tokenizer.encode(STORY)
    return ids, llm.generate([ids], GREEDY)[0].new_token_ids


def test_a_prefix_restored_from_host_memory_gives_the_recomputed_tokens(engine, recomputed):
    ids, tokens = recomputed
    llm = engine(RetentionSettings(host_bytes=1 << 20))
    assert llm.generate([ids], GREEDY)[0].new_token_ids == tokens
    evict(llm, ids)
    [again] = llm.generate([ids], GREEDY)
    stats = llm.core.stats()
    full_pages = (len(ids) - 1) // 4 * 4
    assert again.new_token_ids == tokens
    assert again.num_cached_tokens == stats.prefix_cache_host_hit_tokens == full_pages
    assert stats.retained_bytes_host_to_gpu == full_pages // 4 * llm.core.tiers.page_bytes > 0


def test_states_on_disk_survive_a_restart(engine, recomputed, tmp_path):
    ids, tokens = recomputed
    first = engine(disk_retention(tmp_path, drain_s=5.0))
    assert first.generate([ids], GREEDY)[0].new_token_ids == tokens
    first.core.close()                                      # a clean stop: the host tier is written down
    written = list(tmp_path.glob("*/*.kv"))
    assert len(written) >= (len(ids) - 1) // 4
    second = engine(disk_retention(tmp_path))
    assert second.core.stats().retained_disk_pages == len(written)
    [again] = second.generate([ids], GREEDY)
    assert again.new_token_ids == tokens
    assert again.num_cached_tokens == second.core.stats().prefix_cache_disk_hit_tokens == (len(ids) - 1) // 4 * 4


def test_another_package_never_reads_them(engine, recomputed, tmp_path):
    ids, tokens = recomputed
    first = engine(disk_retention(tmp_path, drain_s=5.0))
    first.generate([ids], GREEDY)
    first.core.close()
    other = engine(disk_retention(tmp_path, identity="ef" * 32))
    assert other.core.stats().retained_disk_pages == 0
    [again] = other.generate([ids], GREEDY)
    assert again.new_token_ids == tokens and again.num_cached_tokens == 0


def restart_with_one_file_changed(engine, tmp_path, ids, change):
    first = engine(disk_retention(tmp_path, drain_s=5.0))
    first.generate([ids], GREEDY)
    first.core.close()
    store_key = first.core.allocator.content_hashes("probe", ids, 0, 3)[2]      # the third page's file
    first.core.allocator.free("probe")
    [folder] = tmp_path.iterdir()
    path = folder / f"{store_key.hex()}.kv"
    change(path)
    return engine(disk_retention(tmp_path, drain_s=5.0)), path


def test_a_damaged_file_is_noted_deleted_and_recomputed(engine, recomputed, tmp_path, capsys):
    ids, tokens = recomputed

    damaged = []

    def damage(path):
        data = bytearray(path.read_bytes())
        data[5000] ^= 0xFF                                  # a payload byte
        damaged.append(bytes(data))
        path.write_bytes(damaged[0])

    llm, path = restart_with_one_file_changed(engine, tmp_path, ids, damage)
    [again] = llm.generate([ids], GREEDY)
    assert again.new_token_ids == tokens
    assert again.num_cached_tokens == 8                     # the two pages before it; the rest is computed
    assert llm.core.stats().retained_read_failures == 1
    assert f"{path} fails its checksum; deleted" in capsys.readouterr().err
    store = llm.core.runner.store
    key, parts = bytes.fromhex(path.name.removesuffix(".kv")), store.host.slot_parts(0)
    llm.core.close()                                        # the recomputed page is written down again
    assert path.read_bytes() != damaged[0]
    DiskStore(tmp_path, IDENTITY, store.layout, store.slot_bytes).read(key, [bytearray(len(p)) for p in parts])


def test_a_foreign_file_is_noted_and_never_served(engine, recomputed, tmp_path, capsys):
    ids, tokens = recomputed

    def replace_with_foreign(path):
        foreign = DiskStore(tmp_path / "elsewhere", "ef" * 32, "another layout", 16)
        key = bytes.fromhex(path.name.removesuffix(".kv"))
        foreign.write(key, [memoryview(bytes(16))])
        data = foreign.path(key).read_bytes()
        path.write_bytes(data + bytes(path.stat().st_size - len(data)))    # same size as ours: listed

    llm, path = restart_with_one_file_changed(engine, tmp_path, ids, replace_with_foreign)
    [again] = llm.generate([ids], GREEDY)
    assert again.new_token_ids == tokens and again.num_cached_tokens == 8
    notes = capsys.readouterr().err
    assert f"{path} was written for another package or KV format" in notes and notes.rstrip().endswith("skipped")
    assert path.exists()                                    # not ours to delete


def test_a_full_disk_is_noted_and_serving_goes_on(engine, recomputed, tmp_path, monkeypatch, capsys):
    ids, tokens = recomputed

    def full(self, key, parts):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(DiskStore, "write", full)
    llm = engine(disk_retention(tmp_path, drain_s=5.0))
    assert llm.generate([ids], GREEDY)[0].new_token_ids == tokens
    evict(llm, ids)
    [again] = llm.generate([ids], GREEDY)
    stats = llm.core.stats()
    assert again.new_token_ids == tokens and again.num_cached_tokens > 0     # the host tier still serves
    assert stats.retained_write_failures > 0 and stats.retained_disk_pages == 0
    notes = capsys.readouterr().err
    assert notes.count("No space left on device") == 1 and "stay in host memory" in notes


def test_direct_transport_reads_what_it_wrote(engine, recomputed, tmp_path):
    from flare.engine.retention.disk_store import check_direct_io

    if check_direct_io(tmp_path) is not None:
        pytest.skip(f"O_DIRECT here: {check_direct_io(tmp_path)}")
    ids, tokens = recomputed
    first = engine(disk_retention(tmp_path, transport="direct", drain_s=5.0))
    first.generate([ids], GREEDY)
    first.core.close()
    second = engine(disk_retention(tmp_path, transport="direct"))
    [again] = second.generate([ids], GREEDY)
    assert again.new_token_ids == tokens and second.core.stats().prefix_cache_disk_hit_tokens > 0


def test_a_latent_cache_comes_back_from_host_memory_as_it_left(tmp_path, checked):
    # DeepSeek-V2's latent cache (one row of latent and rotary key per token and layer, page-major): the
    # restored prefix gives the tokens a GPU prefix hit of the same length gives.
    from tiny_checkpoints import write_tiny_checkpoint

    checkpoint = write_tiny_checkpoint("deepseek_v2", tmp_path / "tiny-deepseek")
    config = EngineConfig(page_size=4, num_pages=40, max_model_len=128, max_concurrency=2,
                          prefix_retention=RetentionSettings(host_bytes=1 << 20))
    llm = checked(LLMEngine.from_checkpoint(checkpoint, config))
    ids = llm.tokenizer.encode(STORY)
    llm.generate([ids], GREEDY)
    [from_the_gpu] = llm.generate([ids], GREEDY)
    evict(llm, ids)
    [from_the_host] = llm.generate([ids], GREEDY)
    full_pages = (len(ids) - 1) // 4 * 4
    assert from_the_gpu.num_cached_tokens == from_the_host.num_cached_tokens == full_pages
    assert from_the_host.new_token_ids == from_the_gpu.new_token_ids
    assert llm.core.stats().prefix_cache_host_hit_tokens == full_pages
    assert llm.core.runner.store.layout.startswith("float32[4,48]")       # 32 latent + 16 rotary per row
    llm.core.close(drain=False)
