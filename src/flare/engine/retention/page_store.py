"""Prefix retention, runner side: carries out a plan's `PageTransfers` and reports them done.

Host memory and its copies to and from the GPU are `host_pages.HostPages`; disk files `disk_store.DiskStore`;
the shared pool `pool_client.PoolClient`. GPU copies go on the copy stream at once (`apply` returns
without waiting); disk and pool work goes to a few worker threads, each first waiting for the copy
stream's last operation on its host slot. `guard` makes the serving stream wait for a copy out of a GPU
page before a row writes the page again (only when the page was reclaimed that soon), and `news` says
which tickets are done, never waiting unless asked to.
"""

from __future__ import annotations

import sys
import time
from collections import deque
from collections.abc import Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, ThreadPoolExecutor, wait
from pathlib import Path

import torch

from flare.engine.retention.disk_store import DiskStore, RetainedFileError
from flare.engine.retention.host_pages import BLOCK_ALIGN, HostPages, check_page_views, page_bytes, page_layout
from flare.engine.retention.settings import RetentionSettings
from flare.engine.step import PageTransfers, StoredPage, TransferNews

WORKERS = 4                     # threads for disk and pool work


def print_note(text: str) -> None:
    print(f"prefix cache: {text}", file=sys.stderr, flush=True)


class RetainedPages:
    def __init__(self, pages: Sequence[torch.Tensor], num_pages: int, settings: RetentionSettings,
                 note=print_note) -> None:
        """`pages`: page-major views of every cache tensor on the GPU's KV pages (`num_pages` of them)."""
        self.note = note
        check_page_views(pages, num_pages)
        slot_bytes = page_bytes(pages)
        slots = (settings.host_bytes - BLOCK_ALIGN * len(pages)) // slot_bytes     # within the budget, padding too
        if slots < 1:
            raise ValueError(f"[prefix_cache] memory ({settings.host_bytes:,} bytes) holds no page of "
                             f"{slot_bytes:,} bytes")
        self.layout = page_layout(pages)
        self.host = HostPages(pages, slots)
        self.disk = self.pool = None
        if settings.disk is not None:
            self.disk = DiskStore(Path(settings.disk.directory), settings.identity, self.layout, slot_bytes,
                                  settings.disk.transport)
        if settings.pool is not None:
            from flare.engine.retention.pool_client import PoolClient

            self.pool = PoolClient(settings.pool, settings.identity, self.layout, slot_bytes, note)
        self._workers = (ThreadPoolExecutor(WORKERS, thread_name_prefix="flare-retention")
                         if settings.stores_below_host else None)
        self._copies: deque[tuple[object, tuple[int, ...]]] = deque()  # (event, GPU pages) copies under way
        self._page_events: dict[int, object] = {}      # GPU page -> the event its copy is done at
        self._slot_events: dict[int, object] = {}      # host slot -> the copy stream's last event on it
        self._loads: list[tuple[int, object]] = []      # (ticket, event)
        self._jobs: dict[int, list[Future]] = {}        # ticket -> its disk and pool jobs
        self._noted: set[str] = set()

    @property
    def num_slots(self) -> int:
        return self.host.num_slots

    @property
    def slot_bytes(self) -> int:
        return self.host.slot_bytes

    def disk_listing(self) -> tuple[bytes, ...]:
        """The disk folder's page files, least recently used first (noting files skipped)."""
        if self.disk is None:
            return ()
        keys, notes = self.disk.listing()
        for text in notes:
            self.note(text)
        return keys

    # ---- orders ------------------------------------------------------------------------------------

    def apply(self, transfers: PageTransfers) -> None:
        self._forget_finished_copies()
        if transfers.saves:
            self._track(self.host.save(transfers.saves), transfers.saves)
        for load in transfers.loads:
            event = self.host.load(load.copies)
            self._track(event, load.copies)
            self._loads.append((load.ticket, event))
        for key in transfers.discards:
            self._workers.submit(self.disk.delete, key)
        self._submit(transfers.writes, self._write)
        self._submit(transfers.reads, self._read)
        self._submit_batches(transfers.pool_writes, self._publish)
        self._submit_batches(transfers.pool_reads, self._fetch_from_pool)

    def guard(self, page_lists: Iterable[Sequence[int]]) -> None:
        """Before a step writes these GPU pages: wait (on the device) for a copy still reading them."""
        if not self._page_events:
            return
        waited = set()
        stream = torch.cuda.current_stream(self.host.device)
        for pages in page_lists:
            for page in pages:
                event = self._page_events.get(page)
                if event is not None and id(event) not in waited and not event.query():
                    stream.wait_event(event)
                    waited.add(id(event))

    # ---- news --------------------------------------------------------------------------------------

    def news(self, wait_s: float = 0.0) -> TransferNews:
        done, failed = self._collect()
        deadline = time.monotonic() + wait_s
        while not done and not failed and (self._loads or self._jobs) and time.monotonic() < deadline:
            futures = [future for jobs in self._jobs.values() for future in jobs]
            if futures and not self._loads:
                wait(futures, max(0.0, deadline - time.monotonic()), FIRST_COMPLETED)
            else:
                time.sleep(0.0005)
            done, failed = self._collect()
        return TransferNews(tuple(done), tuple(failed))

    def close(self, deadline_s: float) -> None:
        """Let disk and pool work finish for up to `deadline_s`, drop what has not started, stop."""
        if self._workers is not None:
            futures = [future for jobs in self._jobs.values() for future in jobs]
            finished, unfinished = wait(futures, deadline_s) if futures else (set(), set())
            if unfinished:
                self.note(f"stopped with {len(unfinished):,} page writes not done (drain_on_shutdown's "
                          f"{deadline_s:g} s ran out)")
            self._workers.shutdown(wait=True, cancel_futures=True)
        if self.pool is not None:
            self.pool.close()
        if self.host.on_cuda:
            torch.cuda.synchronize(self.host.device)
        self.host.close()

    # ---- internals -------------------------------------------------------------------------------

    def _track(self, event, copies) -> None:
        if event is None:
            return
        pages = tuple(copy.page for copy in copies)
        self._copies.append((event, pages))
        for copy in copies:
            self._page_events[copy.page] = event
            self._slot_events[copy.slot] = event

    def _forget_finished_copies(self) -> None:
        while self._copies and self._copies[0][0].query():
            event, pages = self._copies.popleft()
            for page in pages:
                if self._page_events.get(page) is event:
                    del self._page_events[page]
        if not self._copies:
            self._slot_events.clear()

    def _submit(self, orders: Sequence[StoredPage], job) -> None:
        for order in orders:
            future = self._workers.submit(job, order, self._slot_events.get(order.slot))
            self._jobs.setdefault(order.ticket, []).append(future)

    def _submit_batches(self, orders: Sequence[StoredPage], job) -> None:
        by_ticket: dict[int, list[StoredPage]] = {}
        for order in orders:
            by_ticket.setdefault(order.ticket, []).append(order)
        for ticket, batch in by_ticket.items():
            events = [self._slot_events.get(order.slot) for order in batch]
            self._jobs.setdefault(ticket, []).append(self._workers.submit(job, batch, events))

    def _collect(self) -> tuple[list[int], list[tuple[int, bytes]]]:
        done, failed = [], []
        still = []
        for ticket, event in self._loads:
            if event is None or event.query():
                done.append(ticket)
            else:
                still.append((ticket, event))
        self._loads = still
        for ticket, jobs in list(self._jobs.items()):
            if all(job.done() for job in jobs):
                del self._jobs[ticket]
                for job in jobs:
                    failed += [(ticket, key) for key in job.result()]
                done.append(ticket)
        return done, failed

    def _write(self, order: StoredPage, event) -> list[bytes]:
        if event is not None:
            event.synchronize()                         # the slot's copy from the GPU is in
        try:
            self.disk.write(order.key, self.host.slot_parts(order.slot))
        except OSError as error:
            self._note_once(f"write-{error.errno}", f"could not write {self.disk.path(order.key)}: "
                            f"{error.strerror or error}; retained states stay in host memory, and the disk "
                            "tier holds no more than it has now")
            return [order.key]
        return []

    def _read(self, order: StoredPage, event) -> list[bytes]:
        if event is not None:
            event.synchronize()                         # nothing on the copy stream reads the slot any more
        try:
            self.disk.read(order.key, self.host.slot_parts(order.slot))
        except RetainedFileError as error:
            if error.kind != "missing":                 # another server sharing the folder removed it
                self.note(str(error))
            return [order.key]
        except OSError as error:
            self._note_once(f"read-{error.errno}", f"could not read {self.disk.path(order.key)}: "
                            f"{error.strerror or error}; the prefix is computed again")
            return [order.key]
        return []

    def _publish(self, batch: list[StoredPage], events) -> list[bytes]:
        for event in events:
            if event is not None:
                event.synchronize()
        self.pool.put([(order.key, self.host.slot_parts(order.slot)) for order in batch])
        return []                                       # the pool is best effort: nobody waits for it

    def _fetch_from_pool(self, batch: list[StoredPage], events) -> list[bytes]:
        for event in events:
            if event is not None:
                event.synchronize()
        found = self.pool.get([(order.key, self.host.slot_parts(order.slot)) for order in batch])
        return [order.key for order in batch if order.key not in found]

    def _note_once(self, kind: str, text: str) -> None:
        if kind not in self._noted:
            self._noted.add(kind)
            self.note(text)
