"""The scheduler -> runner contract: what one engine step computes, and what the runner answers.

Hot path, kept small: frozen plain data (ids, counts, tuples, SamplingParams, an int32 numpy mask) as
msgspec Structs (built hundreds of times a step: several times cheaper than frozen dataclasses), so a
plan pickles to another process unchanged and every tensor-parallel rank can run the same plan.

The runner never sees the page allocator or the core's Request objects. A request crosses once, when it
takes a batch slot (`NewRequest`; again after a preemption, with the output it has so far); afterwards
only deltas cross: new pages, the tokens to compute, the slots to free. What each side may assume
(docs/architecture.md, "Scheduler -> runner"):

* Plans reach the runner in order, each once; the runner applies a plan in this order: free the slots
  of `finished_request_ids` and `preempted_request_ids`, seat `new_requests`, then for each row append
  `new_page_ids` to its slot's page table and compute its tokens. A slot is freed before it is reused.
* A row computes positions `num_computed_tokens .. num_computed_tokens + num_new_tokens` of its request,
  and its slot's pages cover them. The token at a position is one the request crossed with, or the latest
  token the runner sampled for the slot (it may still be on the device), or, for the last `num_drafts`
  positions, a draft: first the `draft_token_ids` the core proposed, then `num_proposed` the runner's
  draft model proposes itself.
* A sampling row's answer holds 1 .. 1 + k ids: the drafts accepted in order, then one sampled id.
* The runner may be asked to launch step N+1 before step N's result is read; results are read in launch
  order. A row may belong to a request that finished meanwhile: the core discards its answer.
* `samples_ahead(params)` False means the runner needs a request's step-N ids on the host before it
  samples that request again (the core then reads step N's result before planning step N+1).
* Prefix retention (`PageTransfers`, a runner with `retained_slots`): a plan's transfers are ordered after
  every step launched before it and before any later step writes the pages they touch; their device
  copies run beside the steps, never in a step's way. GPU pages a plan hands a row (`new_page_ids`) may
  have a copy out still running: the runner lets the row write them only after it. A load's pages are
  read by no row before `transfer_news` reported its ticket, and a host slot is the target of a copy
  only once the disk or pool operation on it before was reported.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import msgspec
import numpy as np

from flare.engine.outputs import TokenLogprob
from flare.engine.sampling_params import SamplingParams


class NewRequest(msgspec.Struct, frozen=True):
    """A request taking a batch slot: what the runner keeps for it until the slot is freed."""

    request_id: str
    slot: int
    prompt_token_ids: tuple[int, ...]
    output_token_ids: tuple[int, ...]       # non-empty when it resumes after a preemption
    params: SamplingParams


class ScheduledRow(msgspec.Struct, frozen=True):
    """One request's work in a step, in its slot."""

    request_id: str
    slot: int
    num_computed_tokens: int                # tokens whose K/V is cached before this step: the first position
    num_new_tokens: int                     # tokens computed this step, draft tokens included
    new_page_ids: tuple[int, ...] = ()      # appended to the slot's page table before the step
    samples: bool = False                   # the row reaches the request's end: sample after it
    draft_token_ids: tuple[int, ...] = ()   # drafts the core proposed, after the fed tokens (speculation)
    # Grammar bitmask for the sampled positions: int32 [1 + len(draft_token_ids), ceil(V / 32)], bit
    # t % 32 of word t // 32 set = token t allowed (xgrammar's layout). None: every token allowed.
    token_mask: np.ndarray | None = None
    num_proposed: int = 0                   # drafts the runner's draft model proposes after draft_token_ids
    # Window pages (a cache with a "window" kind, flare.engine.cache_pages): the slot's window table takes
    # `window_page_ids` at blocks window_first_block.. before the step; blocks below its window are stale.
    window_first_block: int = 0
    window_page_ids: tuple[int, ...] = ()

    @property
    def num_drafts(self) -> int:
        """The row's last tokens that are drafts, to verify."""
        return len(self.draft_token_ids) + self.num_proposed

    @property
    def num_fed_tokens(self) -> int:
        """Tokens of the row that are not drafts."""
        return self.num_new_tokens - len(self.draft_token_ids) - self.num_proposed


class PageCopy(msgspec.Struct, frozen=True, array_like=True):
    """One page's K/V between a GPU page and a host slot of the retained tiers (every cache tensor's page)."""

    page: int
    slot: int


class PageLoad(msgspec.Struct, frozen=True):
    """Host slots copied into GPU pages for one waiting request; `ticket` is reported once they are there."""

    ticket: int
    copies: tuple[PageCopy, ...]


class StoredPage(msgspec.Struct, frozen=True, array_like=True):
    """A host slot and the chained content hash of the page it holds, for the tiers below the host (disk,
    pool); `ticket` is reported when the write or read is done (or failed: `TransferNews.failed`)."""

    ticket: int
    slot: int
    key: bytes


class PageTransfers(msgspec.Struct, frozen=True):
    """What a plan moves between the GPU pages and the retained tiers (flare.engine.retention)."""

    saves: tuple[PageCopy, ...] = ()        # GPU page -> host slot: cached pages that became evictable
    loads: tuple[PageLoad, ...] = ()        # host slot -> GPU page: a request's prefix found below the GPU
    writes: tuple[StoredPage, ...] = ()     # host slot -> disk: written down, least recently used first
    reads: tuple[StoredPage, ...] = ()      # disk -> host slot: found there, wanted on the GPU
    pool_writes: tuple[StoredPage, ...] = ()    # host slot -> the shared pool
    pool_reads: tuple[StoredPage, ...] = ()     # the shared pool -> host slot (a page it lacks: failed)
    discards: tuple[bytes, ...] = ()        # disk files to delete (given up for room)

    def __bool__(self) -> bool:
        return bool(self.saves or self.loads or self.writes or self.reads or self.pool_writes
                    or self.pool_reads or self.discards)


class TransferNews(msgspec.Struct, frozen=True):
    """What the runner finished since it was last asked: tickets whose every part is done, and the parts
    that failed ((ticket, key): a damaged or missing file, a full disk, a pool that did not answer)."""

    done: tuple[int, ...] = ()
    failed: tuple[tuple[int, bytes], ...] = ()


class StepPlan(msgspec.Struct, frozen=True):
    rows: tuple[ScheduledRow, ...]
    new_requests: tuple[NewRequest, ...] = ()
    finished_request_ids: tuple[str, ...] = ()      # finished or aborted since the last plan: forget them
    preempted_request_ids: tuple[str, ...] = ()     # preempted since the last plan: they come back as new
    transfers: PageTransfers | None = None          # prefix retention's copies, ordered before the rows

    @property
    def num_batched_tokens(self) -> int:
        return sum(row.num_new_tokens for row in self.rows)


class PromptLogprobs(msgspec.Struct, frozen=True):
    """Logprobs of prompt tokens `first_token .. first_token + len(entries)` (each scored by the row before)."""

    first_token: int
    entries: tuple[TokenLogprob, ...]


class StepResult(msgspec.Struct, frozen=True):
    """The runner's answer, row by row in the plan's order."""

    token_ids: tuple[tuple[int, ...], ...]                      # 1 .. 1 + k ids per sampling row, () otherwise
    logprobs: tuple[tuple[TokenLogprob, ...], ...] = ()         # one per id, for rows that asked; () otherwise
    prompt_logprobs: tuple[PromptLogprobs | None, ...] = ()     # for rows whose request asked

    def row_logprobs(self, index: int) -> tuple[TokenLogprob, ...]:
        return self.logprobs[index] if self.logprobs else ()

    def row_prompt_logprobs(self, index: int) -> PromptLogprobs | None:
        return self.prompt_logprobs[index] if self.prompt_logprobs else None


class PendingStep(Protocol):
    def result(self) -> StepResult:
        """Wait until the step's ids are on the host; called once, in launch order."""


class SamplingLater(Protocol):
    """A step launched before the grammar masks of its constrained rows were known."""

    def sample_with(self, rows: tuple[int, ...], masks: np.ndarray) -> PendingStep:
        """Finish the step: `masks` int32 [len(rows), ceil(V / 32)] are the masks of plan rows `rows` (one
        sampled position each: constrained rows carry no drafts); the answer is `launch`'s."""


class StepRunner(Protocol):
    """A runner may also offer `launch_before_masks(plan) -> SamplingLater`: start the step, and take the
    constrained rows' masks once the host has filled them (the model runner launches a decode step's
    forward pass meanwhile). The core uses it when the runner has it, and `launch` with the masks in the
    plan's rows otherwise."""

    vocab_size: int

    def reset(self) -> None:
        """Free every slot: a new engine core plans from empty slots (the old one's plans end here)."""

    def launch(self, plan: StepPlan) -> PendingStep:
        """Apply the plan's deltas and start the step; returns without waiting for its ids."""

    def samples_ahead(self, params: SamplingParams) -> bool:
        """Whether a request with these params may be sampled again before its last ids reach the host."""


class RetainedGeometry(msgspec.Struct, frozen=True):
    """What a retaining runner holds below the GPU, for the core's books: host slots of one page each, the
    size of a page file, and the page files found on disk (their keys, least recently used first)."""

    host_slots: int
    slot_bytes: int
    disk_file_bytes: int = 0
    disk_keys: tuple[bytes, ...] = ()


class RetainingRunner(StepRunner, Protocol):
    """A runner that keeps prefix states below the GPU (flare.engine.retention); plans carry its
    `PageTransfers`."""

    def retained_geometry(self) -> RetainedGeometry | None:
        """What it keeps below the GPU, the disk's page files listed now; None when it retains nothing."""

    def transfer_news(self, wait_s: float = 0.0) -> TransferNews:
        """The transfers finished since the last call; waits up to `wait_s` for one when none has."""

    def close_retention(self, deadline_s: float) -> None:
        """Finish the disk writes ordered so far within `deadline_s` seconds, then stop the tiers' workers."""


@dataclass(frozen=True)
class DoneStep:
    """A PendingStep whose answer is known already (runners that compute on the host)."""

    answer: StepResult

    def result(self) -> StepResult:
        return self.answer


def with_token_masks(plan: StepPlan, rows: tuple[int, ...], masks: np.ndarray) -> StepPlan:
    """The plan with `masks[j]` as the token mask of row `rows[j]` (one sampled position each)."""
    replaced = list(plan.rows)
    for i, mask in zip(rows, masks):
        replaced[i] = msgspec.structs.replace(replaced[i], token_mask=mask[None, :])
    return msgspec.structs.replace(plan, rows=tuple(replaced))
