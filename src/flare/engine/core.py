"""EngineCore: requests in, token ids out. Scheduler + page allocator + model runner, one step at a time.

The core speaks token ids only; text, stop strings and streaming live in the frontend
(`flare.frontend.output_processor`). The same core runs in-process (`LLMEngine`) and in its own
process (`flare.engine.core_process`).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable
from dataclasses import dataclass
from typing import Protocol

from flare.engine.config import EngineConfig
from flare.engine.kv_cache import KVCacheIntegrityError, PageAllocator
from flare.engine.outputs import CoreOutput
from flare.engine.request import EngineRequest, Request, check_stop
from flare.engine.scheduler import RunnerOutput, Scheduler, SchedulerOutput


class InvalidRequest(ValueError):
    """A request the engine cannot take as given; the message says what to change."""


class Runner(Protocol):
    vocab_size: int

    def execute(self, scheduled: SchedulerOutput, allocator: PageAllocator) -> RunnerOutput: ...


@dataclass(frozen=True)
class EngineStats:
    """The core's numbers after its latest step. Counters only grow; gauges are the state now."""

    num_running: int                        # gauge
    num_waiting: int                        # gauge
    kv_pages_used: int                      # gauge: pages requests hold (resident cache pages nobody uses excluded)
    kv_pages_total: int
    num_preemptions: int                    # counter
    prefix_cache_hit_tokens: int = 0        # counter: prompt tokens served from the prefix cache
    prefix_cache_miss_tokens: int = 0       # counter: prompt tokens computed (hits + misses = prompt tokens)
    prefix_cache_evicted_pages: int = 0     # counter: cached pages reclaimed for new content
    prefix_cache_resident_pages: int = 0    # gauge: pages holding reusable cached content, in use or not
    num_computed_tokens: int = 0            # counter: tokens the model computed (prefill and decode)
    # The page integrity check (`EngineCore.check_integrity`) as of these numbers: "ok", the problem it
    # found, or "unchecked" when these stats were taken without running it.
    page_integrity: str = "unchecked"


class EngineCore:
    def __init__(self, config: EngineConfig, runner: Runner, eos_token_ids: Iterable[int] = ()) -> None:
        self.config = config
        self.runner = runner
        self.eos_token_ids = frozenset(eos_token_ids)
        self.allocator = PageAllocator(config.num_pages, config.page_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.allocator)
        self.requests: dict[str, Request] = {}
        self._arrivals = itertools.count()
        self._num_preemptions = 0
        self._num_computed_tokens = 0

    def add_request(self, engine_request: EngineRequest) -> None:
        """Queue a request from an in-process caller; InvalidRequest for a prompt the engine cannot serve."""
        self._check_unused_id(engine_request.request_id)
        validate_prompt(engine_request.prompt_token_ids, self.config.max_model_len, self.runner.vocab_size)
        self._queue(engine_request)

    def add_validated_request(self, engine_request: EngineRequest) -> None:
        """Queue a request whose prompt `validate_prompt` already accepted against this engine's limits.

        The engine-core process takes requests this way: the AsyncEngine that sends them validated them
        where they entered, so the prompt is not scanned again."""
        self._check_unused_id(engine_request.request_id)
        self._queue(engine_request)

    def _queue(self, engine_request: EngineRequest) -> None:
        request = Request(engine_request, next(self._arrivals))
        self.requests[request.request_id] = request
        self.scheduler.add(request)

    def abort(self, request_ids: Iterable[str]) -> None:
        """Drop requests (unknown or finished ids are ignored) and free their pages at once."""
        for request_id in request_ids:
            request = self.requests.pop(request_id, None)
            if request is not None:
                request.finish_reason = "abort"
                self.scheduler.finish(request)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    def step(self) -> list[CoreOutput]:
        """Schedule, run the model once and return the news of every request that got a token."""
        if not self.scheduler.has_unfinished():
            return []
        scheduled = self.scheduler.schedule()
        self._num_preemptions += len(scheduled.preempted_ids)
        if not scheduled.chunks:
            return []
        return self._update(scheduled, self.runner.execute(scheduled, self.allocator))

    def check_integrity(self) -> None:
        """Raise KVCacheIntegrityError if a page is leaked or double-owned; also check the request lists."""
        self.allocator.check_integrity()
        queued = {r.request_id for r in self.scheduler.running} | {r.request_id for r in self.scheduler.waiting}
        if queued != set(self.requests):
            raise KVCacheIntegrityError(f"scheduler holds {sorted(queued)} but the core tracks {sorted(self.requests)}")
        for request in self.scheduler.running:
            held = len(self.allocator.page_table(request.request_id))
            if held < self.allocator.pages_for(request.num_computed_tokens):
                raise KVCacheIntegrityError(
                    f"request {request.request_id!r} computed {request.num_computed_tokens} tokens but holds {held} pages")

    def stats(self, check_integrity: bool = False) -> EngineStats:
        """The numbers now; with `check_integrity`, also the page integrity check's result (never raises)."""
        return EngineStats(
            num_running=len(self.scheduler.running), num_waiting=len(self.scheduler.waiting),
            kv_pages_used=self.allocator.num_used_pages, kv_pages_total=self.allocator.num_pages,
            num_preemptions=self._num_preemptions,
            prefix_cache_hit_tokens=self.scheduler.num_prefix_hit_tokens,
            prefix_cache_miss_tokens=self.scheduler.num_prefix_miss_tokens,
            prefix_cache_evicted_pages=self.allocator.num_evicted_pages,
            prefix_cache_resident_pages=self.allocator.num_cached_pages,
            num_computed_tokens=self._num_computed_tokens,
            page_integrity=self._integrity() if check_integrity else "unchecked")

    def _integrity(self) -> str:
        try:
            self.check_integrity()
        except KVCacheIntegrityError as error:
            return f"{type(error).__name__}: {error}"
        return "ok"

    # ---- internals -------------------------------------------------------------------------------

    def _check_unused_id(self, request_id: str) -> None:
        if request_id in self.requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use")

    def _update(self, scheduled: SchedulerOutput, result: RunnerOutput) -> list[CoreOutput]:
        outputs = []
        for chunk in scheduled.chunks:
            request = chunk.request
            request.num_computed_tokens += chunk.num_new_tokens
            self._num_computed_tokens += chunk.num_new_tokens
            self.allocator.commit(request.request_id, request.all_token_ids, request.num_computed_tokens)
            if request.request_id in result.prompt_logprobs:
                request.prompt_logprobs.extend(result.prompt_logprobs[request.request_id])
            if chunk.completes:
                outputs.append(self._append_token(request, result))
        return outputs

    def _append_token(self, request: Request, result: RunnerOutput) -> CoreOutput:
        request.append_output_token(result.sampled[request.request_id])
        finished = check_stop(request, self.eos_token_ids, self.config.max_model_len)
        logprob = result.logprobs.get(request.request_id)
        first = request.num_output_tokens == 1
        output = CoreOutput(
            request_id=request.request_id,
            new_token_ids=(request.output_token_ids[-1],),
            new_logprobs=(logprob,) if logprob is not None else (),
            finish_reason=request.finish_reason,
            stop_token_id=request.stop_token_id,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
            prompt_logprobs=tuple(request.prompt_logprobs) if first and request.prompt_logprobs is not None else None,
        )
        if finished:
            del self.requests[request.request_id]
            self.scheduler.finish(request)
        return output


def validate_prompt(prompt_token_ids, max_model_len: int, vocab_size: int) -> None:
    """Raise InvalidRequest for a prompt the engine cannot serve (empty, too long, unknown ids).

    Checked once per request, where it enters the engine: `EngineCore.add_request` for in-process
    callers, `AsyncEngine.generate` for the served engine (the core process then trusts it). The HTTP
    server's own admission checks come first and answer in the API's error form."""
    if not prompt_token_ids:
        raise InvalidRequest("the prompt is empty; send at least one token")
    if len(prompt_token_ids) >= max_model_len:
        raise InvalidRequest(
            f"the prompt has {len(prompt_token_ids)} tokens, but this model serves at most {max_model_len} "
            "tokens of prompt and output together; shorten the prompt")
    bad = [t for t in prompt_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequest(f"prompt token ids {bad[:5]} are outside the vocabulary (0..{vocab_size - 1})")
