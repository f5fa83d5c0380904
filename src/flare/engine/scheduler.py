"""Continuous-batching scheduler: which requests compute how many tokens in the next step.

A step, in order (the policy, `flare.engine.policy`, sets the prefill cap from the number of decodes,
and the retirement values):
1. Decodes: every running request with one token left to compute gets it.
2. Running requests with more to compute (chunked prefill, or recomputation after a preemption),
   terminal ones first by retirement value, then in admission order, each at most `prefill_chunk`,
   within the step budget and the policy's prefill cap (a terminal request may exceed the cap by its
   retirement value).
3. If nobody was preempted, waiting requests are admitted first come, first served while there is
   room (concurrency, budget, prefill cap, pages). The head of the queue is never skipped, so nobody
   starves. Admission pins the longest cached prefix of the request's tokens and computes the rest;
   the last token is always computed, since sampling needs its logits.

When pages run out for a request, a request admitted after it is preempted: the one with the lowest
retirement value, the newest among equals. Its pages are freed (cached ones stay resident) and it
waits at the head of the queue to recompute prompt and output tokens (nothing it generated is lost).
A request with nobody newer to preempt preempts itself, so the oldest running request always progresses.

A decoding request that carries draft tokens (speculation) computes 1 + k tokens, within the budget.
A running request holds a batch slot (lowest free first) from admission until it finishes, retires or
is preempted. `schedule()` also says what the runner needs to know (`flare.engine.step.StepPlan`):
requests new to their slot, pages added since the last plan, slots freed.

With prefix retention (`tiers`, flare.engine.retention.tiers), admission also asks whether the prompt
continues past its GPU hit into pages held below the GPU. If so the request waits off the queue
(`fetching`) while they are read up to the host and copied into pages it holds, and comes back to the
head of the queue when the core hears they are there (`resume`, `loaded`); the next in line may be
admitted meanwhile. Each plan carries the tiers' transfers, and a plan may carry transfers alone.

The scheduler never touches pages: it asks the allocator yes/no questions and hands it request ids.
"""

from __future__ import annotations

import heapq
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from flare.engine.config import EngineConfig
from flare.engine.kv_cache import PageAllocator
from flare.engine.request import Request, RequestStatus
from flare.engine.step import NewRequest, ScheduledRow, StepPlan

if TYPE_CHECKING:
    from flare.engine.retention.tiers import PrefixTiers


class ScheduledChunk(msgspec.Struct, frozen=True):
    """Tokens `start .. start + num_new_tokens` of `request`, computed this step; the last
    `len(draft_token_ids) + num_proposed` of them are drafts.

    `completes` says the chunk reaches the request's last token, so the step samples a new one.
    """

    request: Request
    start: int
    num_new_tokens: int
    completes: bool
    draft_token_ids: tuple[int, ...] = ()
    num_proposed: int = 0                   # drafts the runner's draft model proposes after draft_token_ids

    @staticmethod
    def of(request: Request, num_new_tokens: int, draft_token_ids: tuple[int, ...] = (),
           num_proposed: int = 0) -> ScheduledChunk:
        start = request.num_computed_tokens
        fed = num_new_tokens - len(draft_token_ids) - num_proposed
        return ScheduledChunk(request, start, num_new_tokens, start + fed == request.num_tokens, draft_token_ids,
                              num_proposed)


@dataclass(frozen=True)
class SchedulerOutput:
    """One step as planned: the plan for the runner, and the request behind each of its rows."""

    plan: StepPlan
    requests: tuple[Request, ...]


@dataclass
class _Planning:
    """The step being planned: its chunks by request id and what is left of its budgets."""

    budget: int
    prefill_left: int = 0
    chunks: dict[str, tuple[ScheduledChunk, bool]] = field(default_factory=dict)   # id -> (chunk, is prefill)
    preempted: list[str] = field(default_factory=list)

    def add(self, chunk: ScheduledChunk, prefill: bool) -> None:
        self.chunks[chunk.request.request_id] = (chunk, prefill)
        self.budget -= chunk.num_new_tokens
        if prefill:
            self.prefill_left = max(0, self.prefill_left - chunk.num_new_tokens)

    def mean_decode_context(self) -> float:
        """The mean context (cached tokens and the new ones) of the decoding rows planned so far; 0 if none."""
        rows = [chunk for chunk, prefill in self.chunks.values() if not prefill]
        if not rows:
            return 0.0
        return sum(chunk.start + chunk.num_new_tokens for chunk in rows) / len(rows)

    def drop(self, request_id: str) -> None:
        """Forget a chunk of a request preempted later in the planning; its tokens go back to the budget."""
        chunk, prefill = self.chunks.pop(request_id, (None, False))
        if chunk is not None:
            self.budget += chunk.num_new_tokens
            if prefill:
                self.prefill_left += chunk.num_new_tokens


class Scheduler:
    def __init__(self, config: EngineConfig, allocator: PageAllocator,
                 clock: Callable[[], float] = time.monotonic, tiers: PrefixTiers | None = None) -> None:
        self.config = config
        self.policy = config.scheduler_policy
        self.allocator = allocator
        self.clock = clock
        self.tiers = tiers
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.fetching: dict[str, Request] = {}      # waiting for their retained prefix to come up
        self._loaded: set[str] = set()              # back in the queue holding the pages it was copied into
        self.retired: dict[str, Request] = {}       # sampled to the end, their last ids on the way
        self.num_prefix_hit_tokens = 0      # counter: prompt tokens served from the prefix cache
        self.num_prefix_miss_tokens = 0     # counter: prompt tokens that had to be computed
        self.num_preemptions = 0            # counter
        self._free_slots = list(range(config.max_concurrency))     # a heap: the lowest free slot first
        self._finished_ids: list[str] = []      # the runner forgets these in the next plan
        self._preempted_ids: list[str] = []

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self._observe_terminal(request, self.clock())       # a one-token request is terminal on arrival
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running or self.retired or self.fetching)

    @property
    def num_waiting(self) -> int:
        return len(self.waiting) + len(self.fetching)

    def resume(self, request_ids) -> None:
        """Requests whose retained pages were read up (or copied in) come back to the head of the queue,
        in arrival order."""
        back = [self.fetching.pop(request_id) for request_id in request_ids if request_id in self.fetching]
        for request in sorted(back, key=lambda r: r.arrival, reverse=True):
            self.waiting.appendleft(request)

    def loaded(self, request_id: str, keys) -> None:
        """A fetching request's retained pages are in the GPU pages it holds: they join the prefix cache."""
        if request_id in self.fetching:
            self.allocator.record_loaded(request_id, keys)
            self._loaded.add(request_id)
            self.resume([request_id])

    def schedule(self) -> SchedulerOutput:
        now = self.clock()
        for request in self.running:
            self._observe_terminal(request, now)
        step = _Planning(self.config.max_num_batched_tokens)
        for request in [r for r in self.running if r.num_uncomputed_tokens == 1]:
            if request.status is RequestStatus.RUNNING and step.budget > 0:
                self._schedule_decode(request, step, now)
        step.prefill_left = self.policy.prefill_cap(self.config.max_num_batched_tokens, self.config.prefill_chunk,
                                                    num_decoding=len(step.chunks),
                                                    mean_context=step.mean_decode_context()
                                                    if self.policy.prices_context else 0.0)
        prefilling = [r for r in self.running if r.num_uncomputed_tokens > 1]
        prefilling.sort(key=lambda r: -self._retirement_value(r, now))      # stable: admission order among equals
        for request in prefilling:
            if request.status is not RequestStatus.RUNNING:
                continue                                    # preempted earlier in this loop
            num_new = self._prefill_size(request, step, now)
            if num_new > 0:
                self._schedule_running(request, num_new, True, step, now)
        # Admitting new work right after a preemption would only cause the next one.
        while (not step.preempted and self.waiting and step.budget > 0
               and len(self.running) < self.config.max_concurrency):
            if not self._admit(self.waiting[0], step, now):
                break
            self.waiting.popleft()
        if self._loaded:
            self._release_loaded()
        return self._output([chunk for chunk, _ in step.chunks.values()])

    def finish(self, request: Request) -> None:
        """Remove a finished or aborted request and give back its pages (its cached pages stay resident)."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.request_id in self.fetching:
            del self.fetching[request.request_id]
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        elif request.status is RequestStatus.RETIRED:
            del self.retired[request.request_id]             # the runner heard of it when it retired
        if request.seated or (request.status is RequestStatus.WAITING and request.num_preemptions):
            self._finished_ids.append(request.request_id)    # the runner may hold state for it
        self._release_slot(request)
        request.status = RequestStatus.FINISHED
        self.allocator.free(request.request_id)
        if self.tiers is not None:
            self.tiers.forget(request.request_id)
            self._loaded.discard(request.request_id)

    def retire(self, request: Request) -> None:
        """A running request whose every remaining token is sampled gives back its slot at once; it
        finishes when its last ids arrive (`finish`). Its last token is never computed. The caller frees
        its pages once their content is recorded for the prefix cache (an id may still be on its way)."""
        self.running.remove(request)
        self._finished_ids.append(request.request_id)
        self._release_slot(request)
        request.status = RequestStatus.RETIRED
        self.retired[request.request_id] = request

    # ---- internals -------------------------------------------------------------------------------

    def _observe_terminal(self, request: Request, now: float) -> None:
        if request.terminal_since is None and request.tokens_left(self.config.max_model_len) <= 1:
            request.terminal_since = now

    def _retirement_value(self, request: Request, now: float) -> float:
        age = None if request.terminal_since is None else now - request.terminal_since
        return self.policy.retirement_value(age)

    def _prefill_size(self, request: Request, step: _Planning, now: float) -> int:
        """Prompt tokens `request` computes this step: a chunk, within the budget and the prefill cap."""
        allowance = step.prefill_left + int(self._retirement_value(request, now))
        return min(request.num_uncomputed_tokens, self.config.prefill_chunk, step.budget, allowance)

    def _schedule_decode(self, request: Request, step: _Planning, now: float) -> None:
        """The request's next token, and the draft tokens it carries (those the core proposed, then those the
        runner's draft model is to propose) as far as budget and length allow."""
        drafts, proposed = request.draft_token_ids, request.num_proposed_drafts
        if drafts or proposed:
            room = max(0, min(step.budget, request.tokens_left(self.config.max_model_len)) - 1)
            drafts = drafts[:room]
            proposed = min(proposed, room - len(drafts))
        self._schedule_running(request, 1 + len(drafts) + proposed, False, step, now, drafts, proposed)

    def _schedule_running(self, request: Request, num_new: int, prefill: bool, step: _Planning, now: float,
                          drafts: tuple[int, ...] = (), proposed: int = 0) -> None:
        target = request.num_computed_tokens + num_new
        if not self._make_room(request, target, step, now):
            return                                          # it preempted itself
        self.allocator.allocate(request.request_id, target, start=request.num_computed_tokens)
        step.add(ScheduledChunk.of(request, num_new, drafts, proposed), prefill)

    def _make_room(self, request: Request, num_tokens: int, step: _Planning, now: float) -> bool:
        """Preempt newer running requests until `request` can hold `num_tokens`; False if it went itself."""
        while not self.allocator.can_allocate(request.request_id, num_tokens, start=request.num_computed_tokens):
            victim = self._victim(request, now)
            self._preempt(victim, step)
            if victim is request:
                return False
        return True

    def _victim(self, request: Request, now: float) -> Request:
        """Among requests admitted after `request`, the lowest retirement value, newest first; else itself."""
        newer = self.running[self.running.index(request) + 1:]
        if not newer:
            return request
        return min(reversed(newer), key=lambda r: self._retirement_value(r, now))

    def _preempt(self, request: Request, step: _Planning) -> None:
        step.drop(request.request_id)
        step.preempted.append(request.request_id)
        self.num_preemptions += 1
        self.running.remove(request)
        if request.seated:
            self._preempted_ids.append(request.request_id)
        self._release_slot(request)
        self.allocator.release_pages(request.request_id)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def _release_slot(self, request: Request) -> None:
        if request.slot is not None:
            heapq.heappush(self._free_slots, request.slot)
        request.slot, request.seated, request.num_pages_sent = None, False, 0
        request.window_blocks_sent = 0

    def _admit(self, request: Request, step: _Planning, now: float) -> bool:
        """Try to start (or resume) the head of the queue; False if its next chunk does not fit now."""
        # Keep the last token uncached: its logits are needed to sample. Prompt logprobs need every
        # prompt position's logits, so a request still wanting them takes nothing from the cache.
        reusable = 0 if request.wants_prompt_logprobs else request.num_tokens - 1
        if request.request_id in self._loaded:               # back with its retained prefix copied in
            self._loaded.discard(request.request_id)
            cached = self.allocator.num_recorded_tokens(request.request_id)
        else:
            cached = self.allocator.match_prefix(request.request_id, request.all_token_ids, reusable)
            if self.tiers is not None and self._fetch_retained(request, cached, reusable):
                return True                                 # it waits off the queue; the next may go
        request.num_computed_tokens = cached
        num_new = self._prefill_size(request, step, now)
        if num_new <= 0 or not self.allocator.can_allocate(request.request_id, cached + num_new, start=cached):
            self.allocator.release_pages(request.request_id)    # unpin the matched prefix; retry next step
            request.num_computed_tokens = 0
            return False
        self.allocator.allocate(request.request_id, cached + num_new, start=cached)
        if self.tiers is not None:
            self.tiers.forget(request.request_id)
        request.status = RequestStatus.RUNNING
        request.slot = heapq.heappop(self._free_slots)
        self.running.append(request)
        step.add(ScheduledChunk.of(request, num_new), prefill=True)
        if request.num_preemptions == 0:
            request.num_cached_tokens = cached
            self.num_prefix_hit_tokens += cached
            self.num_prefix_miss_tokens += request.num_prompt_tokens - cached
        return True

    def _release_loaded(self) -> None:
        """Requests back with loaded pages that were not admitted this step give them back: the pages stay
        in the GPU prefix cache, where their admission finds them, and hold up no request before them."""
        for request_id in self._loaded:
            if self.allocator.holds(request_id):
                self.allocator.release_pages(request_id)
        self._loaded.clear()

    def _fetch_retained(self, request: Request, cached: int, reusable: int) -> bool:
        """Start bringing up the pages of the request's prompt held below the GPU after its `cached` GPU
        hit: a read to the host (its GPU hit is let go meanwhile) or a copy into pages it takes now.
        Returns whether it now waits for them; False leaves it to be admitted as it is."""
        page_size = self.allocator.page_size
        first, last = cached // page_size, reusable // page_size
        if last <= first:
            return False
        request_id = request.request_id
        keys = self.allocator.content_hashes(request_id, request.all_token_ids, first, last)
        found = self.tiers.plan_fetch(request_id, keys, may_read=not request.read_retained)
        if found.reading:
            request.read_retained = True
            self.allocator.release_pages(request_id)
            self.fetching[request_id] = request
            return True
        count = min(len(found.loadable), self.allocator.num_free_pages - 1)   # a page left for the rest
        if count <= 0:
            return False
        pages = self.allocator.take_pages(request_id, count)
        self.tiers.order_load(request_id, found.loadable[:count], pages)
        self.fetching[request_id] = request
        return True

    def _new_window_pages(self, request: Request) -> tuple[int, tuple[int, ...]]:
        """(first block, pages) of the request's window table the runner has not been given (none without a
        window kind): blocks only grow, and those below a window are never sent again."""
        table = self.allocator.window_table(request.request_id)
        first = request.window_blocks_sent
        while first < len(table) and table[first] is None:
            first += 1
        request.window_blocks_sent = len(table)
        return first, tuple(table[first:])

    def _output(self, chunks: list[ScheduledChunk]) -> SchedulerOutput:
        """The plan of these chunks: new seats, the pages each request gained, the slots freed meanwhile,
        and the prefix tiers' transfers.

        With no chunks the freed slots wait for the next plan that carries rows."""
        transfers = self.tiers.take_transfers() if self.tiers is not None else None
        if not chunks:
            return SchedulerOutput(StepPlan((), transfers=transfers), ())
        new_requests, rows = [], []
        for chunk in chunks:
            request = chunk.request
            if not request.seated:
                new_requests.append(NewRequest(request.request_id, request.slot, tuple(request.prompt_token_ids),
                                               tuple(request.output_token_ids), request.params))
                request.seated = True
            table = self.allocator.page_table(request.request_id)
            first, window = self._new_window_pages(request)
            rows.append(ScheduledRow(request.request_id, request.slot, chunk.start, chunk.num_new_tokens,
                                     tuple(table[request.num_pages_sent:]), chunk.completes, chunk.draft_token_ids,
                                     num_proposed=chunk.num_proposed, window_first_block=first,
                                     window_page_ids=window))
            request.num_pages_sent = len(table)
        plan = StepPlan(tuple(rows), tuple(new_requests), tuple(self._finished_ids), tuple(self._preempted_ids),
                        transfers)
        self._finished_ids, self._preempted_ids = [], []
        return SchedulerOutput(plan, tuple(chunk.request for chunk in chunks))
