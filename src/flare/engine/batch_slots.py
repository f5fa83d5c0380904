"""The runner's batch slots: what it keeps per request from step to step (hot path, keep it small).

Host side, one `SlotRequest` per occupied slot: the ids the request crossed with and its sampling
params. Device side, for every slot plus one padding row: the page table, and the id sampled last (the
input of the slot's next decode, read there whether or not it has reached the host). Tables change only
by the pages a plan adds (`flare.engine.step`: deltas, not snapshots). The device sampler's per-slot
tables (`flare.engine.sampler.DeviceSampler`) follow the same seats: written when a request takes a
slot, cleared when it leaves.
"""

from __future__ import annotations

import numpy as np
import torch

from flare.engine.host_copy import upload
from flare.engine.sampler import DeviceSampler
from flare.engine.sampling_params import SamplingParams
from flare.engine.step import NewRequest, StepPlan


class SlotRequest:
    """One request in its slot, as the runner sees it."""

    __slots__ = ("request_id", "params", "prompt_token_ids", "known_token_ids")

    def __init__(self, new: NewRequest) -> None:
        self.request_id = new.request_id
        self.params: SamplingParams = new.params
        self.prompt_token_ids = new.prompt_token_ids
        self.known_token_ids = np.array(new.prompt_token_ids + new.output_token_ids, dtype=np.int64)


class BatchSlots:
    """`max_slots` slots; row `padding_row` of the device tables is the padding rows' (the dummy page)."""

    def __init__(self, max_slots: int, max_pages: int, dummy_page: int, device: torch.device,
                 sampler: DeviceSampler | None = None, window_dummy_page: int | None = None) -> None:
        """`window_dummy_page`: a cache with window pages (flare.engine.cache_pages) keeps a second table,
        `window_page_tables`, by block like the first, whose padding and stale entries name that page."""
        self.sampler = sampler
        self.max_pages = max_pages
        self.padding_row = max_slots
        self.page_tables = torch.full((max_slots + 1, max_pages), dummy_page, dtype=torch.int32, device=device)
        self.window_page_tables = (None if window_dummy_page is None else
                                   torch.full((max_slots + 1, max_pages), window_dummy_page, dtype=torch.int32,
                                              device=device))
        self.last_sampled = torch.zeros(max_slots + 1, dtype=torch.int64, device=device)
        self._slot_of: dict[str, int] = {}
        self.reset()

    def reset(self) -> None:
        """Every slot free (the device tables keep stale rows: a slot's rows are written before they are read)."""
        for slot in self._slot_of.values():
            self._release(slot)
        self.requests: list[SlotRequest | None] = [None] * self.padding_row
        self.num_pages = [0] * self.padding_row
        self._slot_of: dict[str, int] = {}

    def apply(self, plan: StepPlan) -> None:
        """The plan's deltas: free the preempted and finished, seat the new, append the new pages."""
        for request_id in (*plan.preempted_request_ids, *plan.finished_request_ids):
            slot = self._slot_of.pop(request_id, None)
            if slot is not None:
                self.requests[slot] = None
                self._release(slot)
        for new in plan.new_requests:
            if self.requests[new.slot] is not None:
                raise RuntimeError(f"slot {new.slot} is taken by {self.requests[new.slot].request_id!r}; "
                                   f"the plan seats {new.request_id!r} there without freeing it")
            self.requests[new.slot] = SlotRequest(new)
            self.num_pages[new.slot] = 0
            self._slot_of[new.request_id] = new.slot
            if self.sampler is not None:
                # Penalty counts start from the output so far; a seeded request's draws depend only on
                # its seed and positions, so a resumed request samples as it would have.
                self.sampler.add(new.slot, new.params, new.prompt_token_ids, new.output_token_ids)
        self._add_pages(plan)
        if self.window_page_tables is not None:
            self._add_window_pages(plan)

    def _release(self, slot: int) -> None:
        if self.sampler is not None:
            self.sampler.remove(slot)

    def _add_pages(self, plan: StepPlan) -> None:
        """One scatter into the device tables for every page the plan adds."""
        rows, columns, pages = [], [], []
        for row in plan.rows:
            if not row.new_page_ids:
                continue
            first = self.num_pages[row.slot]
            last = first + len(row.new_page_ids)
            if last > self.max_pages:
                raise RuntimeError(f"request {row.request_id!r} would hold {last} pages; a slot holds {self.max_pages}")
            rows += [row.slot] * len(row.new_page_ids)
            columns += range(first, last)
            pages += row.new_page_ids
            self.num_pages[row.slot] = last
        if pages:
            index = to_device(np.array([rows, columns, pages], dtype=np.int64), self.page_tables.device)
            self.page_tables[index[0], index[1]] = index[2].to(torch.int32)


    def _add_window_pages(self, plan: StepPlan) -> None:
        rows, columns, pages = [], [], []
        for row in plan.rows:
            if not row.window_page_ids:
                continue
            last = row.window_first_block + len(row.window_page_ids)
            if last > self.max_pages:
                raise RuntimeError(f"request {row.request_id!r} would reach window block {last}; a slot holds "
                                   f"{self.max_pages}")
            rows += [row.slot] * len(row.window_page_ids)
            columns += range(row.window_first_block, last)
            pages += row.window_page_ids
        if pages:
            index = to_device(np.array([rows, columns, pages], dtype=np.int64), self.window_page_tables.device)
            self.window_page_tables[index[0], index[1]] = index[2].to(torch.int32)


def to_device(array: np.ndarray, device: torch.device) -> torch.Tensor:
    """A host array on `device` without waiting for the device (`host_copy.upload`)."""
    return upload(torch.from_numpy(array), device)
