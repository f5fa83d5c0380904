"""Continuous-batching scheduler: which requests compute how many tokens in the next step.

Policy, in order:
1. Running requests (oldest first) each get their uncomputed tokens, at most `prefill_chunk`, within
   the step's token budget. When pages run out, the newest running request is preempted: its pages
   are freed and it waits, at the head of the queue, to recompute prompt and output tokens (nothing
   it generated is lost). A request that would have to preempt itself is preempted instead.
2. If nobody was preempted, waiting requests are admitted first come, first served while there is
   room (concurrency, budget, pages). The head of the queue is never skipped, so nobody starves.

The scheduler never touches pages: it asks the allocator yes/no questions and hands it request ids.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from flare.engine.config import EngineConfig
from flare.engine.kv_cache import PageAllocator
from flare.engine.outputs import TokenLogprob
from flare.engine.request import Request, RequestStatus


@dataclass(frozen=True)
class ScheduledChunk:
    """Tokens `start .. start + num_new_tokens` of `request`, computed this step.

    `completes` says the chunk reaches the request's last token, so the step samples a new one.
    """

    request: Request
    start: int
    num_new_tokens: int
    completes: bool

    @staticmethod
    def of(request: Request, num_new_tokens: int) -> ScheduledChunk:
        start = request.num_computed_tokens
        return ScheduledChunk(request, start, num_new_tokens, start + num_new_tokens == request.num_tokens)


@dataclass(frozen=True)
class SchedulerOutput:
    chunks: tuple[ScheduledChunk, ...]
    preempted_ids: tuple[str, ...] = field(default=())

    @property
    def num_batched_tokens(self) -> int:
        return sum(chunk.num_new_tokens for chunk in self.chunks)


class Scheduler:
    def __init__(self, config: EngineConfig, allocator: PageAllocator) -> None:
        self.config = config
        self.allocator = allocator
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []

    def add(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.append(request)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        budget = self.config.max_num_batched_tokens
        chunks: list[ScheduledChunk] = []
        preempted: list[str] = []
        for request in list(self.running):
            if request.status is not RequestStatus.RUNNING:
                continue                                    # preempted earlier in this loop
            num_new = min(request.num_uncomputed_tokens, self.config.prefill_chunk, budget)
            if num_new <= 0:
                continue
            if not self._make_room(request, request.num_computed_tokens + num_new, preempted):
                continue                                    # it preempted itself
            self.allocator.allocate(request.request_id, request.num_computed_tokens + num_new)
            chunks.append(ScheduledChunk.of(request, num_new))
            budget -= num_new
        # Admitting new work right after a preemption would only cause the next one.
        while not preempted and self.waiting and budget > 0 and len(self.running) < self.config.max_concurrency:
            chunk = self._admit(self.waiting[0], budget)
            if chunk is None:
                break
            self.waiting.popleft()
            chunks.append(chunk)
            budget -= chunk.num_new_tokens
        return SchedulerOutput(tuple(chunks), tuple(preempted))

    def finish(self, request: Request) -> None:
        """Remove a finished or aborted request and give back its pages."""
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        elif request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        request.status = RequestStatus.FINISHED
        self.allocator.free(request.request_id)

    # ---- internals -------------------------------------------------------------------------------

    def _make_room(self, request: Request, num_tokens: int, preempted: list[str]) -> bool:
        """Preempt the newest running requests until `request` can hold `num_tokens`; False if it went itself."""
        while not self.allocator.can_allocate(request.request_id, num_tokens):
            victim = self.running[-1]
            self._preempt(victim)
            preempted.append(victim.request_id)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        self.allocator.free(request.request_id)
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        request.status = RequestStatus.WAITING
        self.waiting.appendleft(request)

    def _admit(self, request: Request, budget: int) -> ScheduledChunk | None:
        """Try to start (or resume) the head of the queue; None if its next chunk does not fit now."""
        # Keep the last token uncached: its logits are needed to sample. Prompt logprobs need every
        # prompt position's logits, so a request still wanting them takes nothing from the cache.
        reusable = 0 if request.wants_prompt_logprobs else request.num_tokens - 1
        cached = self.allocator.match_prefix(request.request_id, request.all_token_ids, reusable)
        request.num_computed_tokens = cached
        if request.num_preemptions == 0:
            request.num_cached_tokens = cached
        num_new = min(request.num_uncomputed_tokens, self.config.prefill_chunk, budget)
        if not self.allocator.can_allocate(request.request_id, cached + num_new):
            self.allocator.free(request.request_id)         # unpin the matched prefix; retry next step
            request.num_computed_tokens = 0
            return None
        self.allocator.allocate(request.request_id, cached + num_new)
        request.status = RequestStatus.RUNNING
        self.running.append(request)
        return ScheduledChunk.of(request, num_new)


@dataclass(frozen=True)
class RunnerOutput:
    """The model runner's answer to a SchedulerOutput, keyed by request id.

    `sampled` and `logprobs` hold one entry per completing chunk; `prompt_logprobs` the logprobs of
    the prompt tokens this step's chunk predicted (for requests that asked for them).
    """

    sampled: dict[str, int]
    logprobs: dict[str, TokenLogprob] = field(default_factory=dict)
    prompt_logprobs: dict[str, list[TokenLogprob]] = field(default_factory=dict)
