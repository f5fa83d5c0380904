"""The page allocator on its own: reference counts, free list, integrity check, prefix cache and LRU."""

from __future__ import annotations

import pytest

from flare.engine.kv_cache import KVCacheIntegrityError, PageAllocator


def test_allocate_grows_and_free_returns_pages():
    allocator = PageAllocator(num_pages=4, page_size=4, enable_prefix_caching=False)
    assert allocator.can_allocate("a", 16) and not allocator.can_allocate("a", 17)
    allocator.allocate("a", 5)
    assert len(allocator.page_table("a")) == 2
    allocator.allocate("a", 8)                      # still fits in the two pages it holds
    assert len(allocator.page_table("a")) == 2 and allocator.num_free_pages == 2
    assert allocator.can_allocate("b", 8) and not allocator.can_allocate("b", 9)
    allocator.allocate("b", 8)
    with pytest.raises(KVCacheIntegrityError):
        allocator.allocate("c", 1)
    allocator.check_integrity()
    allocator.free("a")
    allocator.free("b")
    assert allocator.num_free_pages == 4
    allocator.check_integrity()


def test_integrity_check_finds_a_leaked_page():
    allocator = PageAllocator(num_pages=4, page_size=4)
    allocator.allocate("a", 4)
    allocator._free.popleft()                       # a page vanishes from the books
    with pytest.raises(KVCacheIntegrityError, match="leaked"):
        allocator.check_integrity()


def test_integrity_check_finds_a_double_owned_page():
    allocator = PageAllocator(num_pages=4, page_size=4)
    allocator.allocate("a", 4)
    allocator.allocate("b", 4)
    allocator._page_tables["b"].append(allocator.page_table("a")[0])   # b uses a's page without a reference
    with pytest.raises(KVCacheIntegrityError, match="refcount"):
        allocator.check_integrity()


def computed(allocator: PageAllocator, request_id: str, tokens: list[int]) -> None:
    """Play the engine: give the request pages for all tokens and mark them computed."""
    allocator.match_prefix(request_id, tokens, 0)
    allocator.allocate(request_id, len(tokens))
    allocator.commit(request_id, tokens, len(tokens))


def test_prefix_cache_shares_full_pages_of_equal_prefixes():
    allocator = PageAllocator(num_pages=8, page_size=4)
    first = list(range(10))                         # two full pages and a partial one
    computed(allocator, "a", first)
    second = list(range(8)) + [50, 51, 52]
    assert allocator.match_prefix("b", second, len(second) - 1) == 8
    assert allocator.page_table("b") == allocator.page_table("a")[:2]
    assert allocator._refcounts[allocator.page_table("a")[0]] == 2
    allocator.check_integrity()
    # A different first page breaks the chain even if the second page's tokens are equal.
    third = [99] + list(range(1, 10))
    assert allocator.match_prefix("c", third, len(third) - 1) == 0
    for request_id in "abc":
        allocator.free(request_id)
    allocator.check_integrity()
    # Freed cached pages stay reusable.
    assert allocator.match_prefix("d", first, len(first) - 1) == 8
    allocator.free("d")
    allocator.check_integrity()


def test_prefix_match_leaves_the_last_token_to_compute():
    allocator = PageAllocator(num_pages=8, page_size=4)
    tokens = list(range(8))
    computed(allocator, "a", tokens)
    allocator.free("a")
    assert allocator.match_prefix("b", tokens, len(tokens) - 1) == 4
    allocator.free("b")


def test_unreferenced_cached_pages_are_evicted_least_recently_used_first():
    allocator = PageAllocator(num_pages=4, page_size=2)
    computed(allocator, "old", [1, 2, 3, 4])
    allocator.free("old")
    computed(allocator, "new", [5, 6, 7, 8])
    allocator.free("new")
    assert allocator.num_free_pages == 4            # cached but reclaimable
    allocator.match_prefix("x", [9], 0)
    allocator.allocate("x", 4)                      # needs two pages: the two of "old" go
    assert allocator.match_prefix("again-new", [5, 6, 7, 8, 0], 4) == 4
    assert allocator.match_prefix("again-old", [1, 2, 3, 4, 0], 4) == 0
    allocator.check_integrity()


def test_pinned_cached_pages_are_never_evicted():
    allocator = PageAllocator(num_pages=3, page_size=2)
    computed(allocator, "a", [1, 2, 3, 4])
    allocator.free("a")
    assert allocator.match_prefix("b", [1, 2, 3, 4, 5], 4) == 4
    assert not allocator.can_allocate("c", 4)       # only one page is not pinned
    assert allocator.can_allocate("c", 2)
    allocator.check_integrity()
