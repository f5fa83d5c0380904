"""CachePages: tokens pages for every block, window pages only where a step reads, prefixes matched in both."""

from __future__ import annotations

import pytest

from flare.engine.cache_pages import CachePages
from flare.engine.kv_cache import KVCacheIntegrityError

PAGE = 4
RETENTION = 5                           # a step starting at s reads window rows back to s - 5


def pages(num_pages=32, num_window=12) -> CachePages:
    return CachePages(num_pages, num_window, PAGE, RETENTION)


def held(table) -> list[int]:
    return [block for block, page in enumerate(table) if page is not None]


def test_a_request_keeps_window_pages_only_over_its_window():
    cache, tokens = pages(), list(range(40))
    cache.allocate("a", 17, start=0)                       # a prompt of 17 tokens: five blocks of both kinds
    assert held(cache.window_table("a")) == [0, 1, 2, 3, 4]
    cache.commit("a", tokens, 17)
    cache.allocate("a", 18, start=17)                      # decoding at 17 reads back to 12: blocks 3, 4
    assert len(cache.page_table("a")) == 5 and held(cache.window_table("a")) == [3, 4]
    cache.allocate("a", 25, start=24)                      # at 24: back to 19, blocks 4..6
    assert held(cache.window_table("a")) == [4, 5, 6]
    assert cache.window.num_free_pages == 12 - 3           # given-back blocks are free again (or cached)
    cache.check_integrity()
    cache.free("a")
    cache.check_integrity()


def test_a_prefix_matches_only_where_its_window_is_still_cached():
    cache, tokens = pages(num_window=6), list(range(40))
    for start in range(0, 33, 8):                          # a prompt of 33 in chunks of 8, each one recorded
        end = min(start + 8, 33)
        cache.allocate("a", end, start=start)
        cache.commit("a", tokens, end)
    cache.free("a")                     # eight full tokens blocks cached; the window's last blocks too
    assert cache.match_prefix("b", tokens, 39) == 32       # 8 blocks; the window reaches back to 27: blocks 6, 7
    assert held(cache.window_table("b")) == [6, 7] and len(cache.page_table("b")) == 8
    cache.free("b")
    # window blocks 6 and 7 evicted (another request takes every window page): the match falls back to
    # the longest prefix whose window survives, here none
    cache.allocate("c", 24, start=0)
    assert cache.match_prefix("d", tokens, 39) == 0
    cache.free("c")
    cache.free("d")
    cache.check_integrity()


def test_window_pages_run_out_before_tokens_pages_and_are_asked_for():
    cache = pages(num_pages=32, num_window=3)
    assert cache.can_allocate("a", 12, start=0)
    assert not cache.can_allocate("a", 13, start=0)        # four window blocks, three pages
    cache.allocate("a", 12, start=0)
    assert cache.can_allocate("a", 16, start=12)           # at 12 only blocks 1, 2 are read: block 0 goes back
    with pytest.raises(KVCacheIntegrityError):
        cache.allocate("b", 8, start=0)
