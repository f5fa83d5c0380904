"""The host tier's book (core side): which page content each host slot holds, least recently used first.

A slot holds one KV page of every cache tensor (the runner's `host_pages.HostPages` owns the bytes); an
entry is keyed by the page's chained content hash, the same key the GPU prefix cache uses. An entry is
`ready` once its bytes are there or on their way by the device's copy stream (a save, or a load after
it, runs in order), and not while a disk or pool read fills it. `pins` counts what still needs the slot
kept (an operation under way, a request waiting to load it); pinned entries are never evicted.
"""

from __future__ import annotations

import heapq
from collections import OrderedDict
from dataclasses import dataclass


@dataclass
class HostEntry:
    slot: int
    ready: bool = True
    origin: str = "host"        # where its content came from: "host" (saved from the GPU), "disk", "pool"
    stored: bool = False        # also on disk: evicting it loses nothing
    published: bool = False     # also offered to the shared pool
    writing: bool = False       # a disk write from it is under way
    pins: int = 0


class HostIndex:
    def __init__(self, num_slots: int) -> None:
        self.num_slots = num_slots
        self._free = list(range(num_slots))              # a heap: the lowest free slot first, so batches run on
        self._entries: OrderedDict[bytes, HostEntry] = OrderedDict()
        self.num_evicted = 0                             # counter: entries given up for new content
        self.num_evicted_unstored = 0                    # counter: of them, entries no disk held

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        return key in self._entries

    def get(self, key: bytes) -> HostEntry | None:
        return self._entries.get(key)

    def touch(self, key: bytes) -> None:
        self._entries.move_to_end(key)

    def add(self, key: bytes, ready: bool = True, origin: str = "host", spare: bool = False) -> HostEntry | None:
        """A slot for `key`'s content (the least recently used unpinned entry gives up its slot when none
        is free; with `spare`, only one held below the host as well); None when there is none to give."""
        slot = self._take_slot(spare)
        if slot is None:
            return None
        entry = self._entries[key] = HostEntry(slot, ready, origin)
        return entry

    def remove(self, key: bytes) -> None:
        entry = self._entries.pop(key)
        heapq.heappush(self._free, entry.slot)

    def pin(self, key: bytes) -> None:
        self._entries[key].pins += 1

    def unpin(self, key: bytes) -> None:
        entry = self._entries.get(key)
        if entry is not None and entry.pins > 0:
            entry.pins -= 1

    def entries(self) -> list[tuple[bytes, HostEntry]]:
        """Every entry, least recently used first."""
        return list(self._entries.items())

    def check(self) -> list[str]:
        """Problems with the book (an engine bug), for the integrity check."""
        slots = [entry.slot for entry in self._entries.values()]
        problems = []
        if len(set(slots)) != len(slots):
            problems.append("two host entries share a slot")
        if set(slots) & set(self._free):
            problems.append("a host slot is both free and held")
        if len(slots) + len(self._free) != self.num_slots:
            problems.append(f"{self.num_slots - len(slots) - len(self._free)} host slots are neither free nor held")
        return problems

    def _take_slot(self, spare: bool = False) -> int | None:
        if self._free:
            return heapq.heappop(self._free)
        for key, entry in self._entries.items():        # least recently used first
            if entry.pins == 0 and entry.ready and (not spare or entry.stored or entry.published):
                del self._entries[key]
                self.num_evicted += 1
                self.num_evicted_unstored += not entry.stored
                return entry.slot
        return None
