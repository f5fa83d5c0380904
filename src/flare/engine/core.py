"""EngineCore: requests in, token ids out. Scheduler + page allocator + model runner, one step ahead.

The core speaks token ids only; text, stop strings and streaming live in the frontend
(`flare.frontend.output_processor`). The same core runs in-process (`LLMEngine`) and in its own
process (`flare.engine.core_process`). It hands the runner a `flare.engine.step.StepPlan` per step and
reads back a `StepResult`; the runner never sees the allocator or a Request.

Each step: admit the requests whose grammars compiled (`grammar_gate`) and those whose retained prefix came
up from below the GPU (`retention.tiers`), plan (`scheduler`, with the drafts `speculation.rounds` offers),
start the step (`launches`: whole, or its forward before its masks), read the step before it, and bring the
requests up to date. Hot path: keep it small.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable

from flare.engine.config import EngineConfig
from flare.engine.grammar_gate import GrammarGate, TokenMasker
from flare.engine.kernel_builds import KernelBuilds
from flare.engine.kv_cache import KVCacheIntegrityError, PageAllocator
from flare.engine.launches import Launched, Planned, Scheduled, StepLauncher
from flare.engine.outputs import CoreOutput
from flare.engine.request import (EngineRequest, InvalidRequest, Request, RequestStatus, check_stop,
                                  validate_prompt)
from flare.engine.retention.tiers import RETENTION_WAIT_S, PrefixTiers
from flare.engine.scheduler import Scheduler
from flare.engine.speculation.rounds import Drafter, SpeculationRounds
from flare.engine.stats import EngineStats, RefusedRequest
from flare.engine.step import ScheduledRow, StepPlan, StepRunner


def page_allocator(config: EngineConfig, retention: PrefixTiers | None = None):
    """The allocator of the engine's cache: one page kind, or tokens and window pages (flare.engine.cache_pages).
    `retention` hears of pages leaving the GPU prefix cache; the tiers keep pages of one kind only."""
    if config.window_pages:
        from flare.engine.cache_pages import CachePages

        if retention is not None:
            raise ValueError("prefix retention below the GPU keeps caches of one page kind; this one has window "
                             "pages: leave EngineConfig.prefix_retention off")
        return CachePages(config.num_pages, config.window_pages, config.page_size, config.window_retention,
                          config.enable_prefix_caching)
    return PageAllocator(config.num_pages, config.page_size, config.enable_prefix_caching, retention=retention)


class EngineCore:
    """`config.one_step_ahead`: plan and launch step N+1 before reading step N's ids (they stay on the
    device and feed step N+1 there), so the host's work overlaps the device's. Outputs are the same
    token for token; a request that finishes at step N wastes its row of step N+1. Steps whose requests
    need their ids on the host before they are planned again (draft tokens, a runner that samples them on
    the host) are read before the next plan instead. A constrained request's mask needs its previous
    token: the next step is planned and, where the runner can (`launch_before_masks`: decode graphs), its
    forward launched first, then the previous step's ids are read, the masks filled and the step's
    sampling launched with them (the device waits only where the fill outlasts the forward). After a
    constrained step's masks the step after it is scheduled, the sampling launched, then that step's
    forward (`_planned`), before the outputs go out: the host's work between steps (receiving, sending,
    stats) then overlaps that forward rather than leaving the device idle behind the short sampling graph."""

    def __init__(self, config: EngineConfig, runner: StepRunner, eos_token_ids: Iterable[int] = (),
                 token_masker: TokenMasker | None = None, drafter: Drafter | None = None) -> None:
        self.config = config
        self.runner = runner
        runner.reset()
        self.eos_token_ids = frozenset(eos_token_ids)
        self.grammar = GrammarGate(token_masker)
        self.speculation = SpeculationRounds(config.speculation, config.decode_graph_sizes, drafter)
        self.launcher = StepLauncher(runner)
        self.kernel_builds = KernelBuilds()            # counts once the core process starts serving
        self.tiers = PrefixTiers.for_runner(config, runner)    # None unless prefix states go below the GPU
        self.allocator = page_allocator(config, self.tiers)
        self.scheduler = Scheduler(config, self.allocator, tiers=self.tiers)
        self.requests: dict[str, Request] = {}       # scheduled, until they finish
        self._arrivals = itertools.count()
        self._num_computed_tokens = 0
        self._in_flight: Launched | None = None
        self._planned: Planned | None = None           # the next step, planned ahead of a constrained one

    # ---- requests in -----------------------------------------------------------------------------

    def add_request(self, engine_request: EngineRequest, wait_for_grammar: bool = True) -> None:
        """Queue a request from an in-process caller; InvalidRequest for a prompt the engine cannot serve.
        A constrained request's grammar is compiled before this returns (InvalidRequest if it cannot be),
        or, with `wait_for_grammar=False`, while the core steps on (see `add_validated_request`)."""
        self._check_unused_id(engine_request.request_id)
        validate_prompt(engine_request.prompt_token_ids, self.config.max_model_len, self.runner.vocab_size)
        self._queue(engine_request, wait_for_grammar)

    def add_validated_request(self, engine_request: EngineRequest) -> None:
        """Queue a request whose prompt `validate_prompt` already accepted against this engine's limits.

        The engine-core process takes requests this way: the AsyncEngine that sends them validated them
        where they entered, so the prompt is not scanned again. A constrained request waits, unscheduled,
        while its grammar compiles on a worker thread, and the other requests step on meanwhile; a grammar
        that fails comes back from `take_refused`."""
        self._check_unused_id(engine_request.request_id)
        self._queue(engine_request, wait_for_grammar=False)

    def take_refused(self) -> list[RefusedRequest]:
        """The requests refused since the last call (their grammars failed to compile)."""
        return self.grammar.take_refused()

    def abort(self, request_ids: Iterable[str]) -> None:
        """Drop requests (unknown or finished ids are ignored) and free their pages at once. A request
        still waiting for its grammar is forgotten (its compile skipped, or its result dropped)."""
        for request_id in request_ids:
            request = self.requests.pop(request_id, None)
            if request is not None:
                request.finish_reason = "abort"
                self.scheduler.finish(request)
            else:
                self.grammar.forget(request_id)

    def has_unfinished(self) -> bool:
        """Requests scheduled or waiting for their grammars, or prefix states still moving between tiers."""
        return (self.scheduler.has_unfinished() or self.grammar.num_waiting > 0
                or (self.tiers is not None and self.tiers.busy))

    def close(self, drain: bool = True) -> None:
        """The end of serving: on a clean stop (`drain`) with drain_on_shutdown, the host tier's pages not
        on disk yet are written there, within its time; then the tiers' workers stop. Nothing runs after."""
        if self.tiers is None:
            return
        if self._in_flight is not None:
            self._receive(self._in_flight)
            self._in_flight = None
        disk = self.config.prefix_retention.disk
        drain_s = disk.drain_s if disk is not None and drain else 0.0
        drained = self.tiers.drain() if drain_s > 0 else None
        if drained is not None:
            self.runner.launch(StepPlan((), transfers=drained)).result()
        self.runner.close_retention(drain_s)
        self.tiers = self.scheduler.tiers = self.allocator.retention = None

    # ---- the loop --------------------------------------------------------------------------------

    def step(self) -> list[CoreOutput]:
        """Launch the next step, then return the news of every request that got a token: from the step
        launched before it (one step ahead), or from this one when it cannot run ahead. Requests whose
        grammars compiled are scheduled first (those that failed go to `take_refused`)."""
        self.speculation.begin_step()
        if self.grammar.num_waiting:
            idle = not self.scheduler.has_unfinished() and self._in_flight is None and self._planned is None
            for request in self.grammar.take_admitted(idle):
                self._schedule(request)
        if self.tiers is not None:
            self._take_transfer_news()
        previous, self._in_flight = self._in_flight, None
        planned, self._planned = self._planned, None
        following = None
        if planned is not None:                 # its forward runs: the masks follow the previous step's ids
            outputs = self._receive(previous) if previous is not None else []
            masks = self._masks_of(planned, None)
            # The step after it is scheduled now, on the host alone, so that its forward follows this
            # step's sampling on the device with no more than its launch in between.
            following = self._schedule_step() if self._plans_ahead(planned) else None
            launched = self.launcher.complete(planned, masks)
        else:
            planned = self._start(self._schedule_step()) if self._has_plans() else None
            launched = self.launcher.complete(planned, self._masks_of(planned, previous)) if planned else None
            outputs = self._receive(previous) if previous is not None else []
            if planned is not None and self._plans_ahead(planned):
                following = self._schedule_step()
        if following is not None:
            self._planned = self._start(following)
        if launched is not None:
            if self.config.one_step_ahead and launched.runs_ahead:
                self._in_flight = launched
            else:
                outputs += self._receive(launched)
        elif self.tiers is not None and previous is None and self.tiers.busy:
            self._take_transfer_news(RETENTION_WAIT_S)      # nothing else to do: wait a little for them
        return outputs

    def _has_plans(self) -> bool:
        """Whether a step is to be planned: requests to schedule, or transfers between the tiers to order."""
        return self.scheduler.has_unfinished() or (self.tiers is not None and self.tiers.has_orders)

    def _take_transfer_news(self, wait_s: float = 0.0) -> None:
        """What the runner finished moving between the tiers: requests whose retained pages came up go
        back to the head of the queue."""
        news = self.runner.transfer_news(wait_s)
        if news.done or news.failed:
            resumed, loaded = self.tiers.apply_news(news)
            for request_id, keys in loaded:
                self.scheduler.loaded(request_id, keys)
            self.scheduler.resume(resumed)

    # ---- numbers and checks ----------------------------------------------------------------------

    def check_integrity(self) -> None:
        """Raise KVCacheIntegrityError if a page is leaked or double-owned; also check the request lists."""
        self.allocator.check_integrity()
        if self.tiers is not None and self.tiers.check():
            raise KVCacheIntegrityError("prefix retention's books are broken: " + "; ".join(self.tiers.check()))
        scheduler = self.scheduler
        queued = ({r.request_id for r in scheduler.running} | {r.request_id for r in scheduler.waiting}
                  | set(scheduler.fetching))
        if queued | set(scheduler.retired) != set(self.requests):
            raise KVCacheIntegrityError(f"scheduler holds {sorted(queued | set(scheduler.retired))} "
                                        f"but the core tracks {sorted(self.requests)}")
        slots = [r.slot for r in scheduler.running]
        if None in slots or len(set(slots)) != len(slots):
            raise KVCacheIntegrityError(f"running requests hold batch slots {slots}: one each, none shared")
        for request in scheduler.running:
            held = len(self.allocator.page_table(request.request_id))
            if held < self.allocator.pages_for(request.num_computed_tokens):
                raise KVCacheIntegrityError(
                    f"request {request.request_id!r} computed {request.num_computed_tokens} tokens but holds {held} pages")

    def stats(self, check_integrity: bool = False) -> EngineStats:
        """The numbers now; with `check_integrity`, also the page integrity check's result (never raises)."""
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=self.scheduler.num_waiting + self.grammar.num_waiting,
            kv_pages_used=self.allocator.num_used_pages, kv_pages_total=self.allocator.num_pages,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_hit_tokens=self.scheduler.num_prefix_hit_tokens,
            prefix_cache_miss_tokens=self.scheduler.num_prefix_miss_tokens,
            prefix_cache_evicted_pages=self.allocator.num_evicted_pages,
            prefix_cache_resident_pages=self.allocator.num_cached_pages,
            num_computed_tokens=self._num_computed_tokens,
            max_step_ms=self.config.scheduler_policy.max_step_ms or 0.0,
            page_integrity=self._integrity() if check_integrity else "unchecked",
            kernel_builds=self.kernel_builds.count, kernel_build_seconds=round(self.kernel_builds.seconds, 3),
            kernel_builds_recent=tuple(self.kernel_builds.recent),
            **(self.tiers.stats(self.config.page_size) if self.tiers is not None else {}),
            **self.speculation.stats())

    def reset_counters(self) -> None:
        """Zero the prompt and compute counters a user reads (after a warm-up, flare.engine.warm_up)."""
        self.scheduler.num_prefix_hit_tokens = self.scheduler.num_prefix_miss_tokens = 0
        self._num_computed_tokens = 0
        if self.tiers is not None:
            self.tiers.reset_counters()

    def _integrity(self) -> str:
        try:
            self.check_integrity()
        except KVCacheIntegrityError as error:
            return f"{type(error).__name__}: {error}"
        return "ok"

    # ---- internals -------------------------------------------------------------------------------

    def _check_unused_id(self, request_id: str) -> None:
        if request_id in self.requests or self.grammar.holds(request_id):
            raise InvalidRequest(f"request id {request_id!r} is already in use")

    def _queue(self, engine_request: EngineRequest, wait_for_grammar: bool) -> None:
        request = self.grammar.take_in(Request(engine_request, next(self._arrivals)), wait_for_grammar)
        if request is not None:
            self._schedule(request)

    def _schedule(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.scheduler.add(request)

    def _schedule_step(self) -> Scheduled | None:
        """Plan the next step (host only); None when nothing is to run."""
        offered = self.speculation.offer(self.scheduler.running, self.grammar.constrains)
        ahead = self.speculation.lets_run_ahead(offered, len(self.scheduler.running))
        scheduled = self.scheduler.schedule()
        plan = scheduled.plan
        return Scheduled(scheduled, offered, ahead) if plan.rows or plan.transfers is not None else None

    def _start(self, step: Scheduled | None) -> Planned | None:
        """Start a scheduled step, whole or, for a step with constrained rows and a runner that can
        (`launch_before_masks`), its forward; the requests advance as if it had run already."""
        if step is None:
            return None
        scheduled = step.scheduled
        planned = self.launcher.start(step, self.grammar.masked_rows(scheduled.plan.rows, scheduled.requests))
        max_model_len = self.config.max_model_len
        for row, request in zip(scheduled.plan.rows, scheduled.requests):
            request.num_computed_tokens += row.num_fed_tokens
            if row.samples:
                request.num_pending_outputs += 1
                planned.runs_ahead = planned.runs_ahead and self._samples_ahead(row, request, step.ahead)
                if request.tokens_left(max_model_len) <= 0:
                    self.scheduler.retire(request)          # its last token is sampled: nothing to plan
            self._commit(request)
        return planned

    def _plans_ahead(self, planned: Planned) -> bool:
        """Whether the step after `planned` is started before `planned`'s outputs go out: after a
        constrained step that runs ahead, with a runner that starts forwards before masks."""
        return (bool(planned.masked) and planned.runs_ahead and self.config.one_step_ahead
                and self.launcher.splits_steps and self.scheduler.has_unfinished())

    def _masks_of(self, planned: Planned, previous: Launched | None):
        """The masks the planned step still needs (None when it was launched whole). `previous` is the step
        still in flight, whose ids they may need (the only step that can hold a row's previous token)."""
        if planned.pending is not None:
            return None
        unread = previous.unread_ids if previous is not None else (lambda requests: [()] * len(requests))
        return self.grammar.masks([planned.requests[i] for i in planned.masked], unread)

    def _samples_ahead(self, row: ScheduledRow, request: Request, ahead: bool) -> bool:
        """Whether the request's next row may be planned before this one's ids arrive (`ahead`: whether
        speculation lets the step run ahead)."""
        if row.num_drafts or self.speculation.holds_back(ahead):
            return False
        if request.samples_ahead is None:                   # its params never change: ask once
            request.samples_ahead = self.runner.samples_ahead(request.params)
        return request.samples_ahead

    def _commit(self, request: Request) -> None:
        """Record the cached pages of the request's computed tokens whose ids are known. A retired request
        gives its pages back once they are all recorded: in the step that retired it, or when the id it
        was still waiting for arrives (before the next plan either way)."""
        status = request.status
        if status is RequestStatus.RUNNING:
            if self.allocator.enable_prefix_caching:
                computed = min(request.num_computed_tokens, len(request.all_token_ids))
                self.allocator.commit(request.request_id, request.all_token_ids, computed)
        elif status is RequestStatus.RETIRED and self.allocator.holds(request.request_id):
            computed = min(request.num_computed_tokens, len(request.all_token_ids))
            self.allocator.commit(request.request_id, request.all_token_ids, computed)
            if computed == request.num_computed_tokens:
                self.allocator.free(request.request_id)

    def _receive(self, launched: Launched) -> list[CoreOutput]:
        """Wait for a launched step's ids and bring its requests up to date; the rows of requests that
        finished or were aborted meanwhile are waste, and dropped."""
        result = launched.read()
        outputs, finished = [], RequestStatus.FINISHED
        computed = 0
        for index, (row, request) in enumerate(zip(launched.plan.rows, launched.requests)):
            if request.status is finished:
                continue
            computed += row.num_fed_tokens
            found = result.row_prompt_logprobs(index)
            if found is not None:
                add_prompt_logprobs(request, found.first_token, found.entries)
            if row.samples:
                token_ids = result.token_ids[index]
                computed += len(token_ids) - 1                     # accepted drafts
                if row.num_drafts:
                    self.speculation.count_round(row.num_drafts, len(token_ids) - 1)
                outputs.append(self._append_tokens(request, token_ids, result.row_logprobs(index)))
        self._num_computed_tokens += computed
        self.speculation.observe(launched.offered, launched.plan.rows, launched.runs_ahead)
        return outputs

    def _append_tokens(self, request: Request, token_ids, logprobs) -> CoreOutput:
        """The ids one sampling row brought (accepted drafts, then a sampled one), up to a finish."""
        request.num_pending_outputs -= 1
        if request.status is RequestStatus.RUNNING:
            request.num_computed_tokens += len(token_ids) - 1      # the accepted drafts' K/V is valid
        first = not request.output_token_ids
        taken = 0
        finished = False
        while taken < len(token_ids) and not finished:
            request.append_output_token(token_ids[taken])
            taken += 1
            finished = check_stop(request, self.eos_token_ids, self.config.max_model_len)
        self._commit(request)
        output = CoreOutput(
            request_id=request.request_id,
            new_token_ids=tuple(token_ids[:taken]),
            new_logprobs=tuple(logprobs[:taken]),
            finish_reason=request.finish_reason,
            stop_token_id=request.stop_token_id,
            num_prompt_tokens=request.num_prompt_tokens,
            num_cached_tokens=request.num_cached_tokens,
            prompt_logprobs=tuple(request.prompt_logprobs) if first and request.prompt_logprobs is not None else None,
        )
        if finished:
            del self.requests[request.request_id]
            self.scheduler.finish(request)
        elif request.status is RequestStatus.RETIRED and request.num_pending_outputs == 0:
            raise KVCacheIntegrityError(f"request {request.request_id!r} retired but did not finish")
        return output


def add_prompt_logprobs(request: Request, first_token: int, entries) -> None:
    """Extend the request's prompt logprobs with the entries it lacks (a chunk replayed after a preemption
    scores positions it has already)."""
    have = len(request.prompt_logprobs)
    if first_token > have:
        raise KVCacheIntegrityError(
            f"request {request.request_id!r}: prompt logprobs from token {first_token}, but it has {have}")
    request.prompt_logprobs.extend(entries[have - first_token:])
