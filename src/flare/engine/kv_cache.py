"""KV page allocator: owns the pages, their reference counts, the free list and the prefix cache.

The scheduler only asks yes/no questions (`can_allocate`) and hands over request ids; it never sees a
reference count. A page is in exactly one of three places:

* the free list (refcount 0, no content hash),
* the evictable LRU (refcount 0, holds a full page of cached content that a later request may reuse),
* one or more page tables (refcount = the number of requests using it).

Prefix cache: every full page of computed tokens gets a content hash chained over all pages before
it, so equal hashes mean equal prefixes. Pages are hashed as they fill (`commit`), prompt and output
tokens alike, so a finished exchange leaves its prompt and its answer resident: the next turn of a
conversation, whose prompt repeats both, finds them. A new request pins the cached pages of its
longest cached prefix (`match_prefix`); when a request is freed its cached pages become evictable,
and they are evicted least recently used first only when free pages run out.

A page hash is SHA-256 over the previous page's hash and the page's token ids: a collision would
silently serve another prompt's KV, so a 64-bit hash is not enough. With prefix retention
(flare.engine.retention) the same hashes key the tiers below the GPU: the allocator tells its `retention`
when a cached page becomes evictable and when one is reclaimed, and a request can take pages that a
retained prefix is copied into (`take_pages`), recorded as cached once the copy is done
(`record_loaded`). Otherwise hashes stay in the engine-core process. A request's tokens only grow,
so the hashes of its full pages are computed once and kept until the request is freed for good
(`free`); a request that gives its pages back to come again (`release_pages`: it could not be
admitted yet, or was preempted) keeps them, so waiting at the head of the queue costs no rehashing.

A model whose cache has a "window" page kind (flare.models.cache_spec: DeepSeek V4's sliding keys and
compressor inputs) gets `CachePages`: one PageAllocator per kind over the same blocks of tokens. Its window
allocator's tables start with released blocks (None) below each request's window: `allocate(..., start=)`
gives back the blocks a step starting at `start` no longer reads (to the LRU when their content is
recorded). A prefix matches as far as the tokens kind has it cached and the window kind still holds the
blocks just before its end.
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter, OrderedDict, deque
from collections.abc import Sequence
from typing import Protocol


class RetentionEvents(Protocol):
    """What prefix retention hears from the GPU prefix cache (flare.engine.retention.tiers.PrefixTiers)."""

    def page_released(self, page: int, key: bytes) -> None:
        """A cached page became evictable (nobody uses it)."""

    def page_evicted(self, page: int) -> None:
        """An evictable cached page is reclaimed for new content."""


class KVCacheIntegrityError(RuntimeError):
    """A page is leaked, double-owned, or its bookkeeping disagrees with itself (an engine bug)."""


class PageAllocator:
    def __init__(self, num_pages: int, page_size: int, enable_prefix_caching: bool = True,
                 retention: RetentionEvents | None = None) -> None:
        self.num_pages = num_pages
        self.retention = retention if enable_prefix_caching else None
        self.page_size = page_size
        self.enable_prefix_caching = enable_prefix_caching
        self._refcounts = [0] * num_pages
        self._free: deque[int] = deque(range(num_pages))
        self._evictable: OrderedDict[int, None] = OrderedDict()   # least recently used first
        self._page_tables: dict[str, list[int | None]] = {}   # None: a block given back below a window
        self._hash_chains: dict[str, list[bytes]] = {}             # request -> hashes of its cached pages
        self._token_hashes: dict[str, list[bytes]] = {}            # request -> hashes of its full pages so far
        self._page_of_hash: dict[bytes, int] = {}
        self._hash_of_page: dict[int, bytes] = {}
        self.num_evicted_pages = 0                                 # counter: cached pages reclaimed

    # ---- questions -------------------------------------------------------------------------------

    @property
    def num_free_pages(self) -> int:
        """Pages a request could get now: free ones plus cached ones nobody uses."""
        return len(self._free) + len(self._evictable)

    @property
    def num_used_pages(self) -> int:
        """Pages some request holds (cached pages nobody uses do not count)."""
        return self.num_pages - self.num_free_pages

    @property
    def num_cached_pages(self) -> int:
        """Pages holding reusable cached content, whether a request uses them now or not."""
        return len(self._hash_of_page)

    def pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def can_allocate(self, request_id: str, num_tokens: int, start: int = 0) -> bool:
        """Whether `request_id`'s pages can grow to hold `num_tokens` tokens in total (`start`: the first
        position the next step computes; only CachePages reads it)."""
        return self._pages_missing(request_id, num_tokens) <= self.num_free_pages

    def holds(self, request_id: str) -> bool:
        """Whether `request_id` holds pages (a page table) now."""
        return request_id in self._page_tables

    def window_table(self, request_id: str) -> list[int | None]:
        """A cache without window pages has none (flare.engine.cache_pages.CachePages has)."""
        return []

    def page_table(self, request_id: str) -> list[int | None]:
        """The request's pages in token order, None for blocks given back (read-only for callers)."""
        return self._page_tables.get(request_id, [])

    def caches(self, key: bytes) -> bool:
        """Whether a GPU page holds the content of chained hash `key` (nothing is pinned or reordered)."""
        return key in self._page_of_hash

    def content_hashes(self, request_id: str, token_ids: Sequence[int], first: int, last: int) -> list[bytes]:
        """The chained hashes of the request's full pages `first .. last - 1` (the tiers' keys)."""
        return [self._content_hash(request_id, token_ids, index) for index in range(first, last)]

    # ---- changes ---------------------------------------------------------------------------------

    def match_prefix(self, request_id: str, token_ids: Sequence[int], max_tokens: int) -> int:
        """Start `request_id`'s page table with the cached pages of its longest cached prefix.

        Matches whole pages only, at most `max_tokens` tokens (the caller keeps at least one token to
        compute, since sampling needs its logits). Returns the number of tokens the pinned pages hold.
        """
        blocks = self.cached_blocks(request_id, token_ids, max_tokens // self.page_size)
        self.pin_blocks(request_id, token_ids, 0, blocks)
        return blocks * self.page_size

    def cached_blocks(self, request_id: str, token_ids: Sequence[int], max_blocks: int) -> int:
        """How many leading blocks of the request's tokens the prefix cache holds (at most `max_blocks`)."""
        if not self.enable_prefix_caching:
            return 0
        for index in range(max_blocks):
            if self._content_hash(request_id, token_ids, index) not in self._page_of_hash:
                return index
        return max_blocks

    def holds_cached(self, request_id: str, token_ids: Sequence[int], first: int, count: int) -> bool:
        """Whether the prefix cache holds blocks first .. first + count - 1 of the request's tokens."""
        return self.enable_prefix_caching and all(
            self._content_hash(request_id, token_ids, index) in self._page_of_hash for index in range(first, first + count))

    def pin_blocks(self, request_id: str, token_ids: Sequence[int], first: int, count: int) -> None:
        """Start `request_id`'s table with the cached pages of blocks first .. first + count - 1 (None below)."""
        if request_id in self._page_tables:
            raise KVCacheIntegrityError(f"request {request_id!r} already holds pages")
        table: list[int | None] = [None] * first
        for index in range(first, first + count):
            page = self._page_of_hash[self._content_hash(request_id, token_ids, index)]
            self._pin(page)
            table.append(page)
        self._page_tables[request_id] = table
        self._hash_chains[request_id] = [self._content_hash(request_id, token_ids, index)
                                         for index in range(first + count)]

    def allocate(self, request_id: str, num_tokens: int, start: int = 0, first_block: int = 0) -> None:
        """Grow `request_id`'s pages to hold `num_tokens` tokens. Ask `can_allocate` first. Blocks below
        `first_block` that the table does not reach yet stay without a page (a window allocator's)."""
        missing = self._pages_missing(request_id, num_tokens, first_block)
        if missing == 0 and request_id in self._page_tables:
            return                                          # the common decode step: room already
        if missing > self.num_free_pages:
            raise KVCacheIntegrityError(
                f"request {request_id!r} needs {missing} more pages, only {self.num_free_pages} are free")
        table = self._page_tables.setdefault(request_id, [])
        self._hash_chains.setdefault(request_id, [])
        while len(table) < first_block:
            table.append(None)
        for _ in range(missing):
            table.append(self._take_page())

    def pages_freed_below(self, request_id: str, block: int) -> int:
        """Pages `release_before(request_id, block)` would make free (those no other request holds)."""
        return sum(page is not None and self._refcounts[page] == 1 for page in self.page_table(request_id)[:block])

    def release_before(self, request_id: str, block: int) -> None:
        """Give back `request_id`'s pages of blocks below `block` (recorded ones stay cached, in the LRU)."""
        table = self._page_tables.get(request_id, [])
        for index in range(min(block, len(table)) - 1, -1, -1):
            if table[index] is None:
                break                                       # released earlier, and everything below it
            self._unpin(table[index])
            table[index] = None

    def take_pages(self, request_id: str, count: int) -> list[int]:
        """Append `count` pages to the request's table for a retained prefix copied in; they hold nothing
        anyone may read until `record_loaded`. Ask `num_free_pages` first."""
        if count > self.num_free_pages:
            raise KVCacheIntegrityError(f"request {request_id!r} takes {count} pages, only {self.num_free_pages} are free")
        pages = [self._take_page() for _ in range(count)]
        self._page_tables[request_id] += pages
        return pages

    def record_loaded(self, request_id: str, keys: Sequence[bytes]) -> None:
        """The request's pages after its recorded ones now hold the content `keys` (chained hashes, in
        order): they join the prefix cache as if the request had computed them."""
        chain = self._hash_chains[request_id]
        table = self._page_tables[request_id]
        for key in keys:
            page = table[len(chain)]
            chain.append(key)
            if key not in self._page_of_hash and page not in self._hash_of_page:
                self._page_of_hash[key] = page
                self._hash_of_page[page] = key

    def num_recorded_tokens(self, request_id: str) -> int:
        """Tokens the request's recorded (cached) pages hold."""
        return len(self._hash_chains.get(request_id, ())) * self.page_size

    def commit(self, request_id: str, token_ids: Sequence[int], num_computed_tokens: int) -> None:
        """Record the content of every page now full of computed tokens, so later requests can share it."""
        if not self.enable_prefix_caching:
            return
        chain = self._hash_chains[request_id]
        table = self._page_tables[request_id]
        for index in range(len(chain), num_computed_tokens // self.page_size):
            page_hash = self._content_hash(request_id, token_ids, index)
            chain.append(page_hash)
            page = table[index]
            if page is None:
                continue                                    # given back before its content was recorded
            # Two requests may compute the same content at once; the first one's page is the cached one.
            if page_hash not in self._page_of_hash and page not in self._hash_of_page:
                self._page_of_hash[page_hash] = page
                self._hash_of_page[page] = page_hash

    def free(self, request_id: str) -> None:
        """Release every page of a finished `request_id`. Cached pages stay reusable until evicted."""
        self.release_pages(request_id)
        self._token_hashes.pop(request_id, None)

    def release_pages(self, request_id: str) -> None:
        """Release every page of `request_id`, which will ask again: its content hashes are kept."""
        table = self._page_tables.pop(request_id, [])
        self._hash_chains.pop(request_id, None)
        # Release the tail first so it is evicted before the prefix pages that more requests share.
        for page in reversed(table):
            if page is not None:
                self._unpin(page)

    # ---- invariants ------------------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise KVCacheIntegrityError if any page is leaked, double-owned or inconsistently recorded."""
        problems: list[str] = []
        owners = Counter(page for table in self._page_tables.values() for page in table if page is not None)
        for request_id, table in self._page_tables.items():
            held = [page for page in table if page is not None]
            if len(set(held)) != len(held):
                problems.append(f"request {request_id!r} holds a page twice: {table}")
        for page in range(self.num_pages):
            if self._refcounts[page] != owners[page]:
                problems.append(f"page {page} has refcount {self._refcounts[page]} but {owners[page]} owners")
        free = set(self._free)
        if len(free) != len(self._free):
            problems.append("the free list holds a page twice")
        if free & set(self._evictable):
            problems.append(f"pages both free and cached: {sorted(free & set(self._evictable))}")
        for page in free:
            if owners[page] or page in self._hash_of_page:
                problems.append(f"free page {page} is owned or cached")
        for page in self._evictable:
            if owners[page] or page not in self._hash_of_page:
                problems.append(f"evictable page {page} is owned or has no content hash")
        accounted = len(free) + len(self._evictable) + len(owners)
        if accounted != self.num_pages:
            problems.append(f"{self.num_pages - accounted} pages are neither free, cached nor owned (leaked)")
        for page_hash, page in self._page_of_hash.items():
            if self._hash_of_page.get(page) != page_hash:
                problems.append(f"page {page}'s content hash is recorded inconsistently")
        if len(self._page_of_hash) != len(self._hash_of_page):
            problems.append("the two content-hash maps differ in size")
        if problems:
            raise KVCacheIntegrityError("KV page bookkeeping is broken: " + "; ".join(problems))

    # ---- internals -------------------------------------------------------------------------------

    def _pages_missing(self, request_id: str, num_tokens: int, first_block: int = 0) -> int:
        missing = -(-num_tokens // self.page_size) - max(len(self._page_tables.get(request_id, ())), first_block)
        return missing if missing > 0 else 0

    def _take_page(self) -> int:
        if self._free:
            page = self._free.popleft()
        else:
            page, _ = self._evictable.popitem(last=False)
            del self._page_of_hash[self._hash_of_page.pop(page)]
            self.num_evicted_pages += 1
            if self.retention is not None:
                self.retention.page_evicted(page)
        self._refcounts[page] = 1
        return page

    def _unpin(self, page: int) -> None:
        self._refcounts[page] -= 1
        if self._refcounts[page] == 0:
            if page in self._hash_of_page:
                self._evictable[page] = None
                if self.retention is not None:
                    self.retention.page_released(page, self._hash_of_page[page])
            else:
                self._free.append(page)

    def _pin(self, page: int) -> None:
        if self._refcounts[page] == 0:
            del self._evictable[page]
        self._refcounts[page] += 1

    def _content_hash(self, request_id: str, token_ids: Sequence[int], index: int) -> bytes:
        """The chained hash of page `index` of the request's tokens, each page hashed once per request."""
        hashes = self._token_hashes.setdefault(request_id, [])
        while len(hashes) <= index:
            hashes.append(self._hash_page(hashes, token_ids, len(hashes)))
        return hashes[index]

    def _hash_page(self, chain: list[bytes], token_ids: Sequence[int], index: int) -> bytes:
        start = index * self.page_size
        digest = hashlib.sha256(chain[-1] if chain else b"")
        digest.update(array("q", token_ids[start:start + self.page_size]).tobytes())
        return digest.digest()
