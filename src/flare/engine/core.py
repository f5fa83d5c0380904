"""EngineCore: requests in, token ids out. Scheduler + page allocator + model runner, one step ahead.

The core speaks token ids only; text, stop strings and streaming live in the frontend
(`flare.frontend.output_processor`). The same core runs in-process (`LLMEngine`) and in its own
process (`flare.engine.core_process`). It hands the runner a `flare.engine.step.StepPlan` per step and
reads back a `StepResult`; the runner never sees the allocator or a Request.

Hot path: keep it small.
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Iterable, Sequence
from concurrent.futures import FIRST_COMPLETED, Future, wait
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from flare.engine.config import EngineConfig
from flare.engine.kernel_builds import KernelBuilds
from flare.engine.kv_cache import KVCacheIntegrityError, PageAllocator
from flare.engine.outputs import CoreOutput
from flare.engine.request import EngineRequest, Request, RequestStatus, check_stop
from flare.engine.scheduler import Scheduler, SchedulerOutput
from flare.engine.speculation.adaptive import VerificationWidth
from flare.engine.speculation.history import HistoryDrafter
from flare.engine.speculation.settings import speculates
from flare.engine.speculation.stats import SpeculationCounters
from flare.engine.step import (PendingStep, SamplingLater, ScheduledRow, StepPlan, StepResult, StepRunner,
                               with_token_masks)


class InvalidRequest(ValueError):
    """A request the engine cannot take as given; the message says what to change."""


# While nothing runs but grammars compile, a step waits at most this long for one to finish, so the loop
# still takes its commands (a new request, an abort) between waits and does not spin meanwhile.
GRAMMAR_WAIT_S = 0.005


class TokenMasker(Protocol):
    """Grammar-constrained decoding plugs in here: the tokens a request may sample next
    (`flare.engine.structured_output.StructuredOutputs`)."""

    def constrains(self, request: Request) -> bool: ...

    def compile(self, request: Request) -> Future:
        """Start preparing a new request's grammar off the core's thread; the future's result is for
        `admit`, or a ValueError (with the reason) for a grammar it cannot constrain the request with."""

    def admit(self, request: Request, compiled: Any) -> None:
        """Take a constrained request whose grammar `compile` prepared."""

    def next_token_masks(self, requests: Sequence[Request], unread: Sequence[tuple[int, ...]]) -> np.ndarray:
        """int32 [len(requests), ceil(V / 32)] (step.ScheduledRow.token_mask): row i for the token after
        request i's received output and then `unread[i]`, the ids a launched step sampled for it that the
        core has not read in yet."""


class Drafter(Protocol):
    """Speculative decoding plugs in here: draft tokens to verify after a request's next token."""

    def propose(self, request: Request, max_tokens: int) -> tuple[int, ...]:
        """At most `max_tokens` drafts to follow the request's received tokens."""


@dataclass(frozen=True)
class EngineStats:
    """The core's numbers after its latest step. Counters only grow; gauges are the state now."""

    num_running: int                        # gauge
    num_waiting: int                        # gauge: queued, and waiting for their grammars to compile
    kv_pages_used: int                      # gauge: pages requests hold (resident cache pages nobody uses excluded)
    kv_pages_total: int
    num_preemptions: int                    # counter
    prefix_cache_hit_tokens: int = 0        # counter: prompt tokens served from the prefix cache
    prefix_cache_miss_tokens: int = 0       # counter: prompt tokens computed (hits + misses = prompt tokens)
    prefix_cache_evicted_pages: int = 0     # counter: cached pages reclaimed for new content
    prefix_cache_resident_pages: int = 0    # gauge: pages holding reusable cached content, in use or not
    num_computed_tokens: int = 0            # counter: tokens the model computed (prefill and decode)
    # setting: the cadence bound `balanced` keeps on steps that carry decodes, in ms (0: none; policy.py)
    max_step_ms: float = 0.0
    # The page integrity check (`EngineCore.check_integrity`) as of these numbers: "ok", the problem it
    # found, or "unchecked" when these stats were taken without running it.
    page_integrity: str = "unchecked"
    # Speculative decoding, counters (flare.engine.speculation.stats): verification rounds (a request's
    # step that carried drafts), drafts verified and accepted, and both by position (entry j: rounds
    # that carried a draft j, and those whose draft j was accepted).
    speculative_rounds: int = 0
    draft_tokens_proposed: int = 0
    draft_tokens_accepted: int = 0
    draft_tokens_proposed_by_position: tuple[int, ...] = ()
    draft_tokens_accepted_by_position: tuple[int, ...] = ()
    # Triton kernels built since serving started (flare.engine.kernel_builds), counters: how many, and the
    # seconds they took, which the steps that launched them waited; the latest ones' names.
    kernel_builds: int = 0
    kernel_build_seconds: float = 0.0
    kernel_builds_recent: tuple[str, ...] = ()


@dataclass(frozen=True)
class RefusedRequest:
    """A request the core took in, then refused while preparing it (its grammar failed to compile)."""

    request_id: str
    reason: str                                 # what to change, as InvalidRequest's message


@dataclass
class _Launched:
    """A step on its way: its plan, the request behind each row, and whether the next plan may be made
    before its ids arrive."""

    plan: StepPlan
    requests: tuple[Request, ...]
    pending: PendingStep
    runs_ahead: bool
    drafts_offered: tuple[int, int] | None = None   # (requests that could carry drafts, drafts each)
    masked: bool = False                        # some row sampled under a grammar mask
    _result: StepResult | None = None

    def read(self) -> StepResult:
        """The step's answer (waits for it once)."""
        if self._result is None:
            self._result = self.pending.result()
        return self._result


@dataclass(frozen=True)
class _Scheduled:
    """A step the scheduler planned, not started yet."""

    scheduled: SchedulerOutput
    offered: tuple[int, int] | None             # drafts offered (speculation), as _Launched.drafts_offered
    ahead: bool = True                          # speculation lets it run ahead (a plain step, adaptive.runs_ahead)


@dataclass
class _Planned:
    """A step planned and started, not yet whole: launched already (`pending`), or waiting for its
    constrained rows' masks, with its forward running (`later`) or not started (both None)."""

    step: _Scheduled
    masked: tuple[int, ...]                     # the plan's rows that sample under a grammar
    pending: PendingStep | None
    later: SamplingLater | None
    runs_ahead: bool


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
        self.token_masker = token_masker
        speculation = config.speculation
        if drafter is None and speculation.history and speculation.draft_tokens:
            drafter = HistoryDrafter()
        self.drafter = drafter
        self.speculation = SpeculationCounters(speculation.draft_tokens)
        self.kernel_builds = KernelBuilds()            # counts once the core process starts serving
        # Steps are planned with drafts: from the drafter, or proposed by the runner's draft model.
        self._speculates = speculation.draft_tokens > 0 and (drafter is not None or speculation.draft_model)
        # Whether a step without drafts may run ahead while speculating: with history drafts alone (a draft
        # model absorbs every step's tokens beside the step, and is not run ahead).
        self._plain_steps_run_ahead = not speculation.draft_model
        self.widths = VerificationWidth(speculation.draft_tokens, speculation.adaptive, speculation.alpha,
                                        speculation.max_verification_tokens, speculation.exact_verification_tokens,
                                        config.decode_graph_sizes)
        self.allocator = PageAllocator(config.num_pages, config.page_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(config, self.allocator)
        self.requests: dict[str, Request] = {}       # scheduled, until they finish
        self._compiling: dict[str, tuple[Request, Future]] = {}   # waiting, unscheduled, for their grammar
        self._refused: list[RefusedRequest] = []
        self._arrivals = itertools.count()
        self._num_computed_tokens = 0
        self._in_flight: _Launched | None = None
        self._planned: _Planned | None = None          # the next step, planned ahead of a constrained one
        self._step_calls = 0
        self._last_answer: tuple[int, float] | None = None    # (step call, perf_counter) of the last step read

    def warm_up_kernels(self) -> bool:
        """On a GPU, before serving: export's warm-up requests (flare.engine.compile_cache.warm_up: prompt
        chunks, a remainder, a mixed step, eager sampling) once in this process, then the counters they moved
        are zeroed. A kernel's first launch in a process loads it (from the package's Triton cache, or builds
        it where a specialization is missing) while its step waits: on the H200 the first requests after
        start waited for 11 such loads (4.9 s) at c=1, outside the decode graphs that start-up captures.
        The warm-up's random prompt may stay in the prefix cache, evictable. Returns whether it ran."""
        from flare.engine.compile_cache import warm_up, warm_up_prompt_tokens

        device = getattr(self.runner, "device", None)
        if getattr(device, "type", None) != "cuda" or self.has_unfinished():
            return False
        prompt_tokens = warm_up_prompt_tokens(self.config.prefill_chunk, self.config.max_model_len)
        warm_up(self, self.runner.vocab_size, prompt_tokens)
        self.scheduler.num_prefix_hit_tokens = self.scheduler.num_prefix_miss_tokens = 0
        self._num_computed_tokens = 0
        return True

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
        refused, self._refused = self._refused, []
        return refused

    def _queue(self, engine_request: EngineRequest, wait_for_grammar: bool) -> None:
        request = Request(engine_request, next(self._arrivals))
        if request.params.grammar is None:
            self._schedule(request)
            return
        if self.token_masker is None:
            raise InvalidRequest("this engine has no vocabulary for constrained decoding (it was built "
                                 "without a tokenizer); send the request without a grammar")
        compiling = self.token_masker.compile(request)
        if wait_for_grammar:
            self._admit_compiled(request, compiling)
        else:
            self._compiling[request.request_id] = (request, compiling)

    def _schedule(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.scheduler.add(request)

    def _admit_compiled(self, request: Request, compiling: Future) -> None:
        """Schedule a constrained request whose grammar is compiled; InvalidRequest if it failed."""
        try:
            compiled = compiling.result()
        except ValueError as error:
            raise InvalidRequest(str(error)) from None
        self.token_masker.admit(request, compiled)
        self._schedule(request)

    def _admit_ready_grammars(self) -> None:
        """Schedule the requests whose grammars compiled since, refuse those whose grammars failed. With
        nothing else to do, wait a little for one (GRAMMAR_WAIT_S) rather than return at once."""
        if not self.scheduler.has_unfinished() and self._in_flight is None and self._planned is None:
            wait([future for _, future in self._compiling.values()], GRAMMAR_WAIT_S, FIRST_COMPLETED)
        for request_id, (request, compiling) in list(self._compiling.items()):
            if compiling.done():
                del self._compiling[request_id]
                try:
                    self._admit_compiled(request, compiling)
                except InvalidRequest as error:
                    self._refused.append(RefusedRequest(request_id, str(error)))

    def abort(self, request_ids: Iterable[str]) -> None:
        """Drop requests (unknown or finished ids are ignored) and free their pages at once. A request
        still waiting for its grammar is forgotten (its compile skipped, or its result dropped)."""
        for request_id in request_ids:
            request = self.requests.pop(request_id, None)
            if request is not None:
                request.finish_reason = "abort"
                self.scheduler.finish(request)
            elif request_id in self._compiling:
                request, compiling = self._compiling.pop(request_id)
                request.finish_reason = "abort"
                compiling.cancel()

    def has_unfinished(self) -> bool:
        """Requests scheduled or waiting for their grammars."""
        return self.scheduler.has_unfinished() or bool(self._compiling)

    def step(self) -> list[CoreOutput]:
        """Launch the next step, then return the news of every request that got a token: from the step
        launched before it (one step ahead), or from this one when it cannot run ahead. Requests whose
        grammars compiled are scheduled first (those that failed go to `take_refused`)."""
        self._step_calls += 1
        if self._compiling:
            self._admit_ready_grammars()
        previous, self._in_flight = self._in_flight, None
        planned, self._planned = self._planned, None
        following = None
        if planned is not None:                 # its forward runs: the masks follow the previous step's ids
            outputs = self._receive(previous) if previous is not None else []
            masks = self._masks_of(planned, None)
            # The step after it is scheduled now, on the host alone, so that its forward follows this
            # step's sampling on the device with no more than its launch in between.
            following = self._schedule_step() if self._plans_ahead(planned) else None
            launched = self._complete(planned, masks)
        else:
            planned = self._start(self._schedule_step()) if self.scheduler.has_unfinished() else None
            launched = self._complete(planned, self._masks_of(planned, previous)) if planned is not None else None
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
        return outputs

    def check_integrity(self) -> None:
        """Raise KVCacheIntegrityError if a page is leaked or double-owned; also check the request lists."""
        self.allocator.check_integrity()
        scheduler = self.scheduler
        queued = {r.request_id for r in scheduler.running} | {r.request_id for r in scheduler.waiting}
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
            num_waiting=len(self.scheduler.waiting) + len(self._compiling),
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
            **self.speculation.stats())

    def _integrity(self) -> str:
        try:
            self.check_integrity()
        except KVCacheIntegrityError as error:
            return f"{type(error).__name__}: {error}"
        return "ok"

    # ---- internals -------------------------------------------------------------------------------

    def _check_unused_id(self, request_id: str) -> None:
        if request_id in self.requests or request_id in self._compiling:
            raise InvalidRequest(f"request id {request_id!r} is already in use")

    def _schedule_step(self) -> _Scheduled | None:
        """Plan the next step (host only); None when nothing is to run."""
        offered = self._propose_drafts() if self._speculates else None
        ahead = offered is None or (offered[1] == 0 and self._plain_steps_run_ahead
                                    and self.widths.runs_ahead(len(self.scheduler.running)))
        scheduled = self.scheduler.schedule()
        return _Scheduled(scheduled, offered, ahead) if scheduled.plan.rows else None

    def _start(self, step: _Scheduled | None) -> _Planned | None:
        """Start a scheduled step, whole or, for a step with constrained rows and a runner that can
        (`launch_before_masks`), its forward; the requests advance as if it had run already."""
        if step is None:
            return None
        scheduled = step.scheduled
        plan = scheduled.plan
        masked = self._masked_rows(scheduled)
        pending = later = None
        if not masked:
            pending = self.runner.launch(plan)
        elif self._splits_steps():
            later = self.runner.launch_before_masks(plan)   # a decode step's forward runs while the masks fill
        runs_ahead, max_model_len = True, self.config.max_model_len
        for row, request in zip(plan.rows, scheduled.requests):
            request.num_computed_tokens += row.num_fed_tokens
            if row.samples:
                request.num_pending_outputs += 1
                runs_ahead = runs_ahead and self._samples_ahead(row, request, step.ahead)
                if request.tokens_left(max_model_len) <= 0:
                    self.scheduler.retire(request)          # its last token is sampled: nothing to plan
            self._commit(request)
        return _Planned(step, masked, pending, later, runs_ahead)

    def _plans_ahead(self, planned: _Planned) -> bool:
        """Whether the step after `planned` is started before `planned`'s outputs go out: after a
        constrained step that runs ahead, with a runner that starts forwards before masks."""
        return (bool(planned.masked) and planned.runs_ahead and self.config.one_step_ahead
                and self._splits_steps() and self.scheduler.has_unfinished())

    def _masks_of(self, planned: _Planned, previous: _Launched | None) -> np.ndarray | None:
        """The masks the planned step still needs (None when it was launched whole). `previous` is the step
        still in flight, whose ids they may need."""
        if planned.pending is not None:
            return None
        return self._token_masks(planned.step.scheduled, planned.masked, previous)

    def _complete(self, planned: _Planned, masks: np.ndarray | None) -> _Launched:
        """Launch what the planned step still lacks: its sampling with `masks` (or the whole step)."""
        step, masked, pending = planned.step, planned.masked, planned.pending
        scheduled = step.scheduled
        if pending is None:
            if planned.later is not None:
                pending = planned.later.sample_with(masked, masks)
            else:
                pending = self.runner.launch(with_token_masks(scheduled.plan, masked, masks))
        return _Launched(scheduled.plan, scheduled.requests, pending, planned.runs_ahead, step.offered,
                         bool(masked))

    def _samples_ahead(self, row: ScheduledRow, request: Request, ahead: bool) -> bool:
        """Whether the request's next row may be planned before this one's ids arrive (`ahead`: whether
        speculation lets the step run ahead)."""
        if row.num_drafts or (self._speculates and not ahead):
            return False
        if request.samples_ahead is None:                   # its params never change: ask once
            request.samples_ahead = self.runner.samples_ahead(request.params)
        return request.samples_ahead

    def _propose_drafts(self) -> tuple[int, int]:
        """Drafts for the decoding requests, as many each as the verification width allows (adaptive:
        chosen from measured acceptance and step cost); returns (requests offered drafts, drafts each)."""
        masker = self.token_masker
        candidates = []
        for request in self.scheduler.running:
            request.draft_token_ids, request.num_proposed_drafts = (), 0
            decoding = request.num_uncomputed_tokens == 1 and request.num_pending_outputs == 0
            if decoding and speculates(request.params) and not (masker is not None and masker.constrains(request)):
                candidates.append(request)
        limit = self.widths.drafts_for(len(candidates))
        for request in candidates:
            drafts = self.drafter.propose(request, limit) if self.drafter is not None else ()
            request.draft_token_ids = drafts
            request.num_proposed_drafts = limit - len(drafts) if self.config.speculation.draft_model else 0
        return len(candidates), limit

    def _splits_steps(self) -> bool:
        """Whether the runner starts a step's forward before its masks (flare.engine.step.StepRunner)."""
        return getattr(self.runner, "launch_before_masks", None) is not None

    def _masked_rows(self, scheduled: SchedulerOutput) -> tuple[int, ...]:
        """The plan's rows that sample for a constrained request."""
        masker = self.token_masker
        if masker is None:
            return ()
        return tuple(i for i, (row, request) in enumerate(zip(scheduled.plan.rows, scheduled.requests))
                     if row.samples and masker.constrains(request))

    def _token_masks(self, scheduled: SchedulerOutput, masked: tuple[int, ...],
                     previous: _Launched | None) -> np.ndarray:
        """The next-token masks of rows `masked`, int32 [len(masked), ceil(V / 32)]. A row whose previous
        token is still in flight waits for `previous`'s ids here (the only step that can hold it)."""
        requests = [scheduled.requests[i] for i in masked]
        unread = [()] * len(masked)
        in_previous = {id(request) for request in previous.requests} if previous is not None else set()
        if any(id(request) in in_previous for request in requests):
            sampled = dict(zip(map(id, previous.requests), previous.read().token_ids))
            unread = [sampled.get(id(request), ()) for request in requests]
        return self.token_masker.next_token_masks(requests, unread)

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

    def _receive(self, launched: _Launched) -> list[CoreOutput]:
        """Wait for a launched step's ids and bring its requests up to date; the rows of requests that
        finished or were aborted meanwhile are waste, and dropped."""
        result = launched.read()
        outputs, finished = [], RequestStatus.FINISHED
        computed = 0
        for index, (row, request) in enumerate(zip(launched.plan.rows, launched.requests)):
            if request.status is finished:
                continue
            computed += row.num_fed_tokens
            found = result.prompt_logprobs[index] if result.prompt_logprobs else None
            if found is not None:
                add_prompt_logprobs(request, found.first_token, found.entries)
            if row.samples:
                token_ids = result.token_ids[index]
                computed += len(token_ids) - 1                     # accepted drafts
                if row.num_drafts:
                    self.speculation.count(row.num_drafts, len(token_ids) - 1)
                    self.widths.observe_round(row.num_drafts, len(token_ids) - 1)
                outputs.append(self._append_tokens(request, token_ids, result.row_logprobs(index)))
        self._num_computed_tokens += computed
        self._observe_speculation(launched)
        return outputs

    def _observe_speculation(self, launched: _Launched) -> None:
        """What a decode step of a speculating core cost, from the previous step's answer to its own (one
        step call apart at most: the loop did not wait for requests in between), and how many of the
        requests offered drafts carried some."""
        if launched.drafts_offered is None:     # not speculating: nothing to measure
            return
        now = time.perf_counter()
        last, self._last_answer = self._last_answer, (self._step_calls, now)
        offered, drafts = launched.drafts_offered
        rows = launched.plan.rows
        if drafts:
            self.widths.observe_coverage(offered, sum(1 for row in rows if row.samples and row.num_drafts))
        if last is None or last[0] < self._step_calls - 1:
            return
        if not all(row.samples and row.num_fed_tokens == 1 for row in rows):
            return                              # a prompt chunk rode along: not a decode step's cost
        if launched.runs_ahead:
            self.widths.observe_ahead(len(rows), now - last[1])
        else:
            self.widths.observe_step(offered, drafts, now - last[1])

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
