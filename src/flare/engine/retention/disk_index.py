"""The disk tier's book (core side): which pages the package's folder holds, within `disk_limit`.

Every file holds one page (its header and one page of every cache tensor) and all have one size, so the
book counts entries. It starts from the folder's listing (the runner's store scans it, oldest first: a
restart finds the states a previous run wrote), adds a page when its write is ordered (reserving its
room; an entry whose write failed is taken back) and gives up the least recently used to make room. A
full disk below the limit lowers the limit to what the folder holds (`shrink_to_fit`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable


class DiskIndex:
    def __init__(self, limit_bytes: int, entry_bytes: int, listing: Iterable[bytes] = ()) -> None:
        self.entry_bytes = entry_bytes
        self.limit_entries = max(0, limit_bytes // entry_bytes)
        self._entries: OrderedDict[bytes, bool] = OrderedDict((key, True) for key in listing)  # key -> written
        self.num_evicted = 0                                  # counter: files given up for new ones
        self.found_at_start = len(self._entries)
        while len(self._entries) > self.limit_entries:        # a lower limit than the last run's
            self._evict_one()

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: bytes) -> bool:
        """Whether the page is on disk (written, not just ordered)."""
        return self._entries.get(key, False)

    @property
    def used_bytes(self) -> int:
        return len(self._entries) * self.entry_bytes

    def touch(self, key: bytes) -> None:
        self._entries.move_to_end(key)

    def reserve(self, key: bytes) -> list[bytes] | None:
        """Room for a write of `key`: the keys to discard for it (least recently used first), or None when
        the limit holds no entry or only ones being written."""
        if key in self._entries:
            return []
        discards = []
        while len(self._entries) >= self.limit_entries:
            evicted = self._evict_one()
            if evicted is None:
                return None
            discards.append(evicted)
        self._entries[key] = False
        return discards

    def written(self, key: bytes) -> None:
        if key in self._entries:
            self._entries[key] = True

    def remove(self, key: bytes) -> None:
        """A write that failed, or a file found damaged or missing."""
        self._entries.pop(key, None)

    def shrink_to_fit(self) -> None:
        """The disk filled up below the limit: hold no more than there is now."""
        self.limit_entries = sum(self._entries.values())

    def _evict_one(self) -> bytes | None:
        for key, written in self._entries.items():
            if written:
                del self._entries[key]
                self.num_evicted += 1
                return key
        return None
