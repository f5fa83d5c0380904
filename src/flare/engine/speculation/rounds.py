"""Speculation's part in each engine step: which decoding requests carry drafts and how many, whether the
step may run ahead, and what a step's answer teaches the verification width.

A round (`VerificationWidth`): the width for the B decoding requests that may carry drafts this step, the
`Drafter`'s drafts for each (history), and what a learned draft model is to propose beyond them. A plain
step (width one) runs ahead while `VerificationWidth.runs_ahead` says it wins; a drafted round needs the
previous step's ids and is read before the next plan. Costs are the wall time between consecutive steps'
answers; steps that carried a prompt chunk are not counted.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Protocol

from flare.engine.request import Request
from flare.engine.speculation.adaptive import VerificationWidth
from flare.engine.speculation.history import HistoryDrafter
from flare.engine.speculation.settings import SpeculationSettings, speculates
from flare.engine.speculation.stats import SpeculationCounters

Offer = tuple[int, int]         # (requests that could carry drafts, drafts each)


class Drafter(Protocol):
    """Speculative decoding plugs in here: draft tokens to verify after a request's next token."""

    def propose(self, request: Request, max_tokens: int) -> tuple[int, ...]:
        """At most `max_tokens` drafts to follow the request's received tokens."""


class SpeculationRounds:
    """The drafts of each step and the measurements that size them. Inactive (`active` False) without
    draft tokens or anything to propose them: every step is then plain and runs ahead."""

    def __init__(self, settings: SpeculationSettings, decode_graph_sizes: tuple[int, ...],
                 drafter: Drafter | None = None) -> None:
        if drafter is None and settings.history and settings.draft_tokens:
            drafter = HistoryDrafter()
        self.settings = settings
        self.drafter = drafter
        self.counters = SpeculationCounters(settings.draft_tokens)
        self.widths = VerificationWidth(settings.draft_tokens, settings.adaptive, settings.alpha,
                                        settings.max_verification_tokens, settings.exact_verification_tokens,
                                        decode_graph_sizes)
        # Steps are planned with drafts: from the drafter, or proposed by the runner's draft model.
        self.active = settings.draft_tokens > 0 and (drafter is not None or settings.draft_model)
        # Whether a step without drafts may run ahead while speculating: with history drafts alone (a draft
        # model absorbs every step's tokens beside the step, and is not run ahead).
        self._plain_steps_run_ahead = not settings.draft_model
        self._step_calls = 0
        self._last_answer: tuple[int, float] | None = None    # (step call, perf_counter) of the last step read

    def begin_step(self) -> None:
        """A call of the core's step: answers one call apart measure a step's cost."""
        self._step_calls += 1

    def offer(self, running: Sequence[Request], constrained: Callable[[Request], bool]) -> Offer | None:
        """Drafts for the decoding requests, as many each as the verification width allows (adaptive:
        chosen from measured acceptance and step cost), set on the requests; None when not speculating."""
        if not self.active:
            return None
        candidates = []
        for request in running:
            request.draft_token_ids, request.num_proposed_drafts = (), 0
            decoding = request.num_uncomputed_tokens == 1 and request.num_pending_outputs == 0
            if decoding and speculates(request.params) and not constrained(request):
                candidates.append(request)
        limit = self.widths.drafts_for(len(candidates))
        for request in candidates:
            drafts = self.drafter.propose(request, limit) if self.drafter is not None else ()
            request.draft_token_ids = drafts
            request.num_proposed_drafts = limit - len(drafts) if self.settings.draft_model else 0
        return len(candidates), limit

    def lets_run_ahead(self, offered: Offer | None, num_running: int) -> bool:
        """Whether a step with this offer may be planned past before its ids arrive."""
        return offered is None or (offered[1] == 0 and self._plain_steps_run_ahead
                                   and self.widths.runs_ahead(num_running))

    def holds_back(self, ahead: bool) -> bool:
        """Whether a row of a step that speculation does not let run ahead (`ahead` False) must be read
        before the request's next row is planned."""
        return self.active and not ahead

    def count_round(self, num_drafts: int, num_accepted: int) -> None:
        """A row that carried `num_drafts` drafts came back with `num_accepted` of them accepted."""
        self.counters.count(num_drafts, num_accepted)
        self.widths.observe_round(num_drafts, num_accepted)

    def observe(self, offered: Offer | None, rows, ran_ahead: bool) -> None:
        """What a decode step of a speculating core cost, from the previous step's answer to its own (one
        step call apart at most: the loop did not wait for requests in between), and how many of the
        requests offered drafts carried some."""
        if offered is None:                     # not speculating: nothing to measure
            return
        now = time.perf_counter()
        last, self._last_answer = self._last_answer, (self._step_calls, now)
        candidates, drafts = offered
        if drafts:
            self.widths.observe_coverage(candidates, sum(1 for row in rows if row.samples and row.num_drafts))
        if last is None or last[0] < self._step_calls - 1:
            return
        if not all(row.samples and row.num_fed_tokens == 1 for row in rows):
            return                              # a prompt chunk rode along: not a decode step's cost
        if ran_ahead:
            self.widths.observe_ahead(len(rows), now - last[1])
        else:
            self.widths.observe_step(candidates, drafts, now - last[1])

    def stats(self) -> dict:
        """The EngineStats fields of speculation."""
        return self.counters.stats()
