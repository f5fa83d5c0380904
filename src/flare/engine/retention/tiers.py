"""Prefix retention, core side: what leaves the GPU for the host, disk and pool, and what comes back.

The GPU prefix cache (flare.engine.kv_cache.PageAllocator) tells `PrefixTiers` when a cached page becomes
evictable (`page_released`) and when one is reclaimed (`page_evicted`). An evictable page not held below
is copied to a host slot by the next plan (`PageTransfers.saves`), so eviction itself never waits for a
copy; a page reclaimed before that plan went out is simply not saved. With a disk tier, host entries are
written down as the disk keeps up, least recently used first (`writes`, at most WRITES_IN_FLIGHT at once),
so the host can give up a slot without losing its content; with a pool they are offered to it too.

A request whose prompt continues past its GPU hit into pages held below waits for them off the queue
(`Scheduler.fetching`): pages on disk or in the pool are first read into host slots (one round), then
the host slots are copied into GPU pages the request holds (`loads`); once the runner reports the
ticket, the pages join the GPU prefix cache and the request is admitted with them computed. The keys are
the chained page hashes of the GPU prefix cache, so every tier answers the same question.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

from flare.engine.retention.disk_index import DiskIndex
from flare.engine.retention.host_index import HostIndex
from flare.engine.retention.settings import RetentionSettings
from flare.engine.step import PageCopy, PageLoad, PageTransfers, StoredPage, TransferNews

WRITES_IN_FLIGHT = 64           # disk and pool writes under way at once (each one page)
RETENTION_WAIT_S = 0.005        # with nothing else to run, a core step waits this long for the runner's news
POOL_READ_PAGES = 1024          # most pages one request asks the pool for


@dataclass
class _Ticket:
    kind: str                   # "read", "pool_read", "load", "write", "pool_write"
    request_id: str | None
    keys: list[bytes]


@dataclass(frozen=True)
class FetchPlan:
    """What admitting a request found below the GPU: reads ordered (it waits for them), or the keys whose
    host slots can be loaded now (possibly none)."""

    reading: bool = False
    loadable: tuple[bytes, ...] = ()


@dataclass(frozen=True)
class RetentionCounters:
    """Counters of the tiers (EngineStats carries them; pages are one page_size of tokens each)."""

    host_hit_pages: int = 0         # pages loaded from host slots that the host had
    disk_hit_pages: int = 0         # pages loaded after a disk read
    pool_hit_pages: int = 0         # pages loaded after a pool read
    saved_pages: int = 0            # GPU -> host
    loaded_pages: int = 0           # host -> GPU
    written_pages: int = 0          # host -> disk
    read_pages: int = 0             # disk -> host
    published_pages: int = 0        # host -> pool
    pool_read_pages: int = 0        # pool -> host
    unsaved_pages: int = 0          # reclaimed on the GPU before their copy out was ordered
    failed_reads: int = 0           # damaged, foreign or missing files
    failed_writes: int = 0
    host_resident_pages: int = 0    # gauge
    disk_resident_pages: int = 0    # gauge


class PrefixTiers:
    def __init__(self, settings: RetentionSettings, host_slots: int, page_bytes: int,
                 disk_listing: tuple[bytes, ...] = (), disk_entry_bytes: int = 0) -> None:
        self.settings = settings
        self.page_bytes = page_bytes
        self.host = HostIndex(host_slots)
        self.disk = (DiskIndex(settings.disk.limit_bytes, disk_entry_bytes, disk_listing)
                     if settings.disk is not None else None)
        self.pool = settings.pool is not None
        self._saves: OrderedDict[int, bytes] = OrderedDict()     # GPU page -> content, to copy out next plan
        self._loads: list[PageLoad] = []
        self._writes: list[StoredPage] = []
        self._reads: list[StoredPage] = []
        self._pool_writes: list[StoredPage] = []
        self._pool_reads: list[StoredPage] = []
        self._discards: list[bytes] = []
        self._tickets: dict[int, _Ticket] = {}
        self._next_ticket = 0
        self._request_pins: dict[str, list[bytes]] = {}
        self._pool_asked: set[str] = set()                       # requests that asked the pool once
        # Host entries to write down (disk, pool), oldest first; an entry gone or done meanwhile is skipped.
        self._unwritten: OrderedDict[bytes, None] = OrderedDict()
        self._writes_in_flight = 0
        self._count = {name: 0 for name in RetentionCounters.__dataclass_fields__}

    @classmethod
    def for_runner(cls, config, runner) -> PrefixTiers | None:
        """The books over what `runner` holds below the GPU for an engine of `config` (EngineConfig); None
        when it retains nothing."""
        settings = config.prefix_retention
        if not settings.enabled or not config.enable_prefix_caching:
            return None
        geometry = runner.retained_geometry()
        if geometry is None:
            raise ValueError("this engine's runner keeps nothing below the GPU; build it without prefix_retention")
        return cls(settings, geometry.host_slots, geometry.slot_bytes, geometry.disk_keys, geometry.disk_file_bytes)

    # ---- the GPU prefix cache's events --------------------------------------------------------------

    def page_released(self, page: int, key: bytes) -> None:
        """A cached GPU page became evictable: copy it out by the next plan unless the host has it."""
        if key in self.host:
            self.host.touch(key)
        elif page not in self._saves:
            self._saves[page] = key

    def page_evicted(self, page: int) -> None:
        """A cached GPU page is reclaimed for new content: its copy out, if still only planned, is dropped."""
        if self._saves.pop(page, None) is not None:
            self._count["unsaved_pages"] += 1

    # ---- admission -----------------------------------------------------------------------------------

    def plan_fetch(self, request_id: str, keys: list[bytes], may_read: bool) -> FetchPlan:
        """The pages of `keys` (a prompt's page hashes after its GPU hit, in order) held below the GPU. With
        `may_read`, the run's pages on disk (and, with a pool, the pages after what is held here) are read
        into host slots, and the request waits for them; otherwise the run's ready host pages come back."""
        self._unpin_request(request_id)                  # what an earlier try pinned
        run: list[tuple[bytes, str]] = []
        for key in keys:
            entry = self.host.get(key)
            if entry is not None:
                if not entry.ready:
                    break                           # another request's read fills it: not ours to wait for
                run.append((key, "host"))
            elif self.disk is not None and key in self.disk:
                run.append((key, "disk"))
            else:
                break
        beyond = keys[len(run):len(run) + POOL_READ_PAGES]
        asks_pool = self.pool and beyond and request_id not in self._pool_asked
        if may_read and (asks_pool or any(where == "disk" for _, where in run)):
            if self._order_reads(request_id, run, beyond if asks_pool else []):
                return FetchPlan(reading=True)
        loadable = []
        for key, where in run:
            if where != "host":
                break
            loadable.append(key)
        return FetchPlan(loadable=tuple(loadable))

    def order_load(self, request_id: str, keys: tuple[bytes, ...], pages: list[int]) -> None:
        """Copy the host slots of `keys` into `pages` (GPU pages the request holds, in its table's order)."""
        ticket = self._ticket("load", request_id, list(keys))
        copies = []
        for key, page in zip(keys, pages):
            self.host.pin(key)
            self.host.touch(key)
            copies.append(PageCopy(page, self.host.get(key).slot))
        self._loads.append(PageLoad(ticket, tuple(copies)))
        self._unpin_request(request_id)             # the load's own pins hold the slots now

    def forget(self, request_id: str) -> None:
        """The request no longer waits for the slots it pinned (admitted, finished or aborted)."""
        self._unpin_request(request_id)
        self._pool_asked.discard(request_id)

    def _unpin_request(self, request_id: str) -> None:
        for key in self._request_pins.pop(request_id, ()):
            self.host.unpin(key)

    # ---- the plan ----------------------------------------------------------------------------------

    def take_transfers(self) -> PageTransfers | None:
        """What the next plan moves (None: nothing)."""
        saves = self._take_saves()
        self._order_writes()
        transfers = PageTransfers(saves=saves, loads=tuple(self._loads), writes=tuple(self._writes),
                                  reads=tuple(self._reads), pool_writes=tuple(self._pool_writes),
                                  pool_reads=tuple(self._pool_reads), discards=tuple(self._discards))
        self._loads, self._writes, self._reads, self._pool_writes, self._pool_reads = [], [], [], [], []
        self._discards = []
        return transfers if transfers else None

    def drain(self) -> PageTransfers | None:
        """At a clean stop: the pending saves, then a disk write of every host entry not on disk yet, most
        recently used first (the stop may end before all are written)."""
        saves = self._take_saves()
        if self.disk is not None:
            for key, entry in reversed(self.host.entries()):
                self._order_write(key, entry)
        transfers = PageTransfers(saves=saves, writes=tuple(self._writes), discards=tuple(self._discards))
        self._writes, self._discards = [], []
        return transfers if transfers else None

    # ---- the runner's news --------------------------------------------------------------------------

    def apply_news(self, news: TransferNews) -> tuple[list[str], list[tuple[str, tuple[bytes, ...]]]]:
        """Bring the books up to date; returns (requests whose reads are done: they come back to the queue,
        loads done as (request, keys): their pages join the GPU prefix cache)."""
        for ticket_id, key in news.failed:
            self._failed(self._tickets[ticket_id], key)
        resumed, loaded = [], []
        for ticket_id in news.done:
            ticket = self._tickets.pop(ticket_id)
            self._done(ticket)
            if ticket.kind == "load":
                loaded.append((ticket.request_id, tuple(ticket.keys)))
            elif ticket.kind in ("read", "pool_read") and ticket.request_id is not None:
                if not any(t.request_id == ticket.request_id and t.kind in ("read", "pool_read")
                           for t in self._tickets.values()):
                    resumed.append(ticket.request_id)
        return resumed, loaded

    @property
    def has_orders(self) -> bool:
        """Whether the next plan would carry transfers (a plan of them alone is worth launching)."""
        return bool(self._saves or self._loads or self._reads or self._pool_reads or self._discards
                    or (self._unwritten and self._writes_in_flight < WRITES_IN_FLIGHT))

    @property
    def busy(self) -> bool:
        """Orders to send, or sent ones the runner has not reported done."""
        return self.has_orders or bool(self._tickets)

    def reset_counters(self) -> None:
        self._count = dict.fromkeys(self._count, 0)

    def stats(self, page_size: int) -> dict:
        """The tiers' fields of EngineStats (flare.engine.stats), pages turned into tokens and bytes."""
        counts, page_bytes = self.counters(), self.page_bytes
        return dict(prefix_cache_host_hit_tokens=counts.host_hit_pages * page_size,
                    prefix_cache_disk_hit_tokens=counts.disk_hit_pages * page_size,
                    prefix_cache_pool_hit_tokens=counts.pool_hit_pages * page_size,
                    retained_bytes_gpu_to_host=counts.saved_pages * page_bytes,
                    retained_bytes_host_to_gpu=counts.loaded_pages * page_bytes,
                    retained_bytes_host_to_disk=counts.written_pages * page_bytes,
                    retained_bytes_disk_to_host=counts.read_pages * page_bytes,
                    retained_bytes_host_to_pool=counts.published_pages * page_bytes,
                    retained_bytes_pool_to_host=counts.pool_read_pages * page_bytes,
                    retained_read_failures=counts.failed_reads, retained_write_failures=counts.failed_writes,
                    retained_host_pages=counts.host_resident_pages, retained_host_slots=self.host.num_slots,
                    retained_disk_pages=counts.disk_resident_pages,
                    retained_disk_bytes=self.disk.used_bytes if self.disk is not None else 0)

    def counters(self) -> RetentionCounters:
        return RetentionCounters(**{**self._count, "host_resident_pages": len(self.host),
                                    "disk_resident_pages": len(self.disk) if self.disk is not None else 0})

    def check(self) -> list[str]:
        problems = self.host.check()
        pinned = sum(entry.pins for _, entry in self.host.entries())
        held = sum(len(keys) for keys in self._request_pins.values())
        held += sum(len(t.keys) for t in self._tickets.values() if t.kind in ("load", "write", "pool_write"))
        held += sum(len(t.keys) for t in self._tickets.values() if t.kind in ("read", "pool_read"))
        if pinned != held:
            problems.append(f"host entries hold {pinned} pins, but {held} are accounted for")
        return problems

    # ---- internals -------------------------------------------------------------------------------

    def _ticket(self, kind: str, request_id: str | None, keys: list[bytes]) -> int:
        ticket = self._next_ticket
        self._next_ticket += 1
        self._tickets[ticket] = _Ticket(kind, request_id, keys)
        return ticket

    def _take_saves(self) -> tuple[PageCopy, ...]:
        copies = []
        for page, key in self._saves.items():
            if key in self.host:
                continue                            # two pages of one content: the first one's copy serves
            entry = self.host.add(key)
            if entry is None:
                break                               # every slot is in use by an operation: try later
            copies.append(PageCopy(page, entry.slot))
            if self.disk is not None or self.pool:
                self._unwritten[key] = None
        self._saves.clear()
        self._count["saved_pages"] += len(copies)
        return tuple(copies)

    def _order_reads(self, request_id: str, run: list[tuple[bytes, str]], from_pool: list[bytes]) -> bool:
        """Reads of the run's disk pages and the pool candidates into host slots; the request's host pages
        are pinned until it comes back. False when nothing could be ordered (no slot)."""
        pins = self._request_pins.setdefault(request_id, [])
        for key, where in run:                      # first, so that no slot below goes to the disk pages
            if where == "host":
                self.host.pin(key)
                pins.append(key)
        disk_keys, pool_keys = [], []
        for key, where in run:
            if where == "host":
                continue
            if self.host.add(key, ready=False, origin="disk") is None:
                break
            disk_keys.append(key)
        else:
            for key in from_pool:
                # A guess (the pool may not have it): only a free slot, or one whose page is held below too.
                if key in self.host or self.host.add(key, ready=False, origin="pool", spare=True) is None:
                    break
                pool_keys.append(key)
        for keys, kind, orders in ((disk_keys, "read", self._reads), (pool_keys, "pool_read", self._pool_reads)):
            if keys:
                ticket = self._ticket(kind, request_id, keys)
                for key in keys:
                    self.host.pin(key)
                    orders.append(StoredPage(ticket, self.host.get(key).slot, key))
        if self.pool:
            self._pool_asked.add(request_id)
        return bool(disk_keys or pool_keys)

    def _order_writes(self) -> None:
        """Disk writes (and pool offers) of host entries not held there yet, oldest first, as far as the
        writes under way leave room."""
        room = WRITES_IN_FLIGHT - self._writes_in_flight
        while room > 0 and self._unwritten:
            key, _ = self._unwritten.popitem(last=False)
            entry = self.host.get(key)
            if entry is not None and entry.ready:
                room -= self._order_write(key, entry) + self._offer_to_pool(key, entry)

    def _order_write(self, key: bytes, entry) -> int:
        if self.disk is None or entry.stored or entry.writing or not entry.ready:
            return 0
        if key in self.disk:
            entry.stored = True
            return 0
        discards = self.disk.reserve(key)
        if discards is None:
            return 0
        self._discards += discards
        entry.writing = True
        self.host.pin(key)
        self._writes.append(StoredPage(self._ticket("write", None, [key]), entry.slot, key))
        self._writes_in_flight += 1
        return 1

    def _offer_to_pool(self, key: bytes, entry) -> int:
        if not self.pool or entry.published or entry.origin == "pool" or not entry.ready:
            return 0
        entry.published = True
        self.host.pin(key)
        self._pool_writes.append(StoredPage(self._ticket("pool_write", None, [key]), entry.slot, key))
        self._writes_in_flight += 1
        return 1

    def _failed(self, ticket: _Ticket, key: bytes) -> None:
        if ticket.kind in ("read", "pool_read"):
            if ticket.kind == "read":               # (the pool not having a page is no failure)
                self._count["failed_reads"] += 1
                self.disk.remove(key)
            self.host.unpin(key)
            self.host.remove(key)
            ticket.keys.remove(key)
        elif ticket.kind == "write":
            self._count["failed_writes"] += 1
            entry = self.host.get(key)
            entry.writing = False
            self.host.unpin(key)
            ticket.keys.remove(key)
            self.disk.remove(key)
            self.disk.shrink_to_fit()
        elif ticket.kind == "pool_write":
            self.host.unpin(key)
            ticket.keys.remove(key)

    def _done(self, ticket: _Ticket) -> None:
        kind = ticket.kind
        if kind in ("write", "pool_write"):
            self._writes_in_flight -= 1
        for key in ticket.keys:
            entry = self.host.get(key)
            self.host.unpin(key)
            if kind in ("read", "pool_read"):
                entry.ready = True
                entry.stored = kind == "read"
                self._count["read_pages" if kind == "read" else "pool_read_pages"] += 1
            elif kind == "write":
                entry.writing, entry.stored = False, True
                self.disk.written(key)
                self._count["written_pages"] += 1
            elif kind == "pool_write":
                self._count["published_pages"] += 1
            elif kind == "load":
                self._count["loaded_pages"] += 1
                self._count[f"{entry.origin}_hit_pages"] += 1
                entry.origin = "host"               # from now on a host hit
                if self.disk is not None and key in self.disk:
                    self.disk.touch(key)
