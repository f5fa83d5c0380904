"""The pages of a cache with two kinds (flare.models.cache_spec): "tokens" pages for every block of a
sequence, "window" pages only for the blocks a request's next step reads.

`CachePages` answers the scheduler's questions as `PageAllocator` does (the scheduler and the core see
one allocator) and keeps one PageAllocator per kind, over the same blocks of `page_size` tokens and the
same chained content hashes:

* a step computing positions start .. end needs tokens pages up to `end` and window pages for the blocks
  from `start - retention` to `end`; `allocate(request, end, start=start)` gives back the window blocks
  below (a block whose content was recorded stays cached, least recently used first);
* a prefix of n blocks matches when the tokens kind has blocks 0 .. n - 1 cached and the window kind the
  blocks its first step reads back to (n * page_size - retention); the longest such n is taken. A finished
  request leaves the window it ended with, so the next turn of a conversation matches at its end.

What the runner is told: `page_table(request)` (tokens pages, every block) as before, and
`window_table(request)` (None for blocks given back), whose new entries the scheduler sends as
`ScheduledRow.window_first_block` / `window_page_ids`. Page ids of the two kinds are separate
(each kind's tensors have their own rows; flare.engine.layer_cache).
"""

from __future__ import annotations

from collections.abc import Sequence

from flare.engine.kv_cache import KVCacheIntegrityError, PageAllocator


class CachePages:
    def __init__(self, num_pages: int, num_window_pages: int, page_size: int, retention: int,
                 enable_prefix_caching: bool = True) -> None:
        self.tokens = PageAllocator(num_pages, page_size, enable_prefix_caching)
        self.window = PageAllocator(num_window_pages, page_size, enable_prefix_caching)
        self.retention = retention
        self.page_size = page_size
        self.num_pages = num_pages
        self.enable_prefix_caching = enable_prefix_caching

    # ---- questions (the tokens kind's, as the scheduler and stats read them) -------------------------

    @property
    def num_free_pages(self) -> int:
        return self.tokens.num_free_pages

    @property
    def num_used_pages(self) -> int:
        return self.tokens.num_used_pages

    @property
    def num_cached_pages(self) -> int:
        return self.tokens.num_cached_pages

    @property
    def num_evicted_pages(self) -> int:
        return self.tokens.num_evicted_pages

    def pages_for(self, num_tokens: int) -> int:
        return self.tokens.pages_for(num_tokens)

    def holds(self, request_id: str) -> bool:
        return self.tokens.holds(request_id)

    def page_table(self, request_id: str) -> list[int | None]:
        return self.tokens.page_table(request_id)

    def window_table(self, request_id: str) -> list[int | None]:
        return self.window.page_table(request_id)

    def first_window_block(self, start: int) -> int:
        """The first block a step starting at position `start` reads from window pages."""
        return max(0, start - self.retention) // self.page_size

    def can_allocate(self, request_id: str, num_tokens: int, start: int = 0) -> bool:
        first = self.first_window_block(start)
        window_missing = self.window._pages_missing(request_id, num_tokens, first)
        freed = self.window.pages_freed_below(request_id, first)
        return (self.tokens.can_allocate(request_id, num_tokens)
                and window_missing <= self.window.num_free_pages + freed)

    # ---- changes -------------------------------------------------------------------------------------

    def match_prefix(self, request_id: str, token_ids: Sequence[int], max_tokens: int) -> int:
        """Pin the longest cached prefix both kinds hold (module docstring); returns its tokens."""
        blocks = self.tokens.cached_blocks(request_id, token_ids, max_tokens // self.page_size)
        while blocks > 0:
            first = self.first_window_block(blocks * self.page_size)
            if self.window.holds_cached(request_id, token_ids, first, blocks - first):
                break
            blocks -= 1
        first = self.first_window_block(blocks * self.page_size)
        self.tokens.pin_blocks(request_id, token_ids, 0, blocks)
        self.window.pin_blocks(request_id, token_ids, first, blocks - first)
        return blocks * self.page_size

    def allocate(self, request_id: str, num_tokens: int, start: int = 0) -> None:
        first = self.first_window_block(start)
        self.window.release_before(request_id, first)
        self.tokens.allocate(request_id, num_tokens)
        self.window.allocate(request_id, num_tokens, first_block=first)

    def commit(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        self.tokens.commit(request_id, token_ids, num_computed_tokens)
        self.window.commit(request_id, token_ids, num_computed_tokens)

    def free(self, request_id: str) -> None:
        self.tokens.free(request_id)
        self.window.free(request_id)

    def release_pages(self, request_id: str) -> None:
        self.tokens.release_pages(request_id)
        self.window.release_pages(request_id)

    def check_integrity(self) -> None:
        self.tokens.check_integrity()
        self.window.check_integrity()
        if set(self.tokens._page_tables) != set(self.window._page_tables):
            raise KVCacheIntegrityError("tokens and window page tables name different requests: "
                                        f"{sorted(self.tokens._page_tables)} and {sorted(self.window._page_tables)}")
