"""Steps on their way through the runner: planned, started (whole, or its forward before its grammar
masks), launched, read. The core's loop holds at most one step launched and unread and one step planned
ahead of a constrained step; these types carry them between its calls, and `StepLauncher` starts them on
the `StepRunner` behind the step contract (flare.engine.step).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from flare.engine.request import Request
from flare.engine.scheduler import SchedulerOutput
from flare.engine.speculation.rounds import Offer
from flare.engine.step import PendingStep, SamplingLater, StepPlan, StepResult, StepRunner, with_token_masks


@dataclass(frozen=True)
class Scheduled:
    """A step the scheduler planned, not started yet."""

    scheduled: SchedulerOutput
    offered: Offer | None                       # drafts offered (speculation.rounds.Offer); None: not speculating
    ahead: bool = True                          # speculation lets it run ahead (a plain step, adaptive.runs_ahead)


@dataclass
class Planned:
    """A step planned and started, not yet whole: launched already (`pending`), or waiting for its
    constrained rows' masks, with its forward running (`later`) or not started (both None)."""

    step: Scheduled
    masked: tuple[int, ...]                     # the plan's rows that sample under a grammar
    pending: PendingStep | None
    later: SamplingLater | None
    runs_ahead: bool = True                     # the next plan may be made before its ids arrive

    @property
    def plan(self) -> StepPlan:
        return self.step.scheduled.plan

    @property
    def requests(self) -> tuple[Request, ...]:
        return self.step.scheduled.requests


@dataclass
class Launched:
    """A step on its way: its plan, the request behind each row, and whether the next plan may be made
    before its ids arrive."""

    plan: StepPlan
    requests: tuple[Request, ...]
    pending: PendingStep
    runs_ahead: bool
    offered: Offer | None = None                # drafts offered to it (speculation)
    masked: bool = False                        # some row sampled under a grammar mask
    _result: StepResult | None = None

    def read(self) -> StepResult:
        """The step's answer (waits for it once)."""
        if self._result is None:
            self._result = self.pending.result()
        return self._result

    def unread_ids(self, requests: Sequence[Request]) -> list[tuple[int, ...]]:
        """The ids this step sampled for each of `requests` (() for those it did not run); waits for the
        step only when one of them is in it."""
        mine = {id(request) for request in self.requests}
        if not any(id(request) in mine for request in requests):
            return [()] * len(requests)
        sampled = dict(zip(map(id, self.requests), self.read().token_ids))
        return [sampled.get(id(request), ()) for request in requests]


class StepLauncher:
    """Starts steps on the runner: whole, or a constrained step's forward before its masks where the runner
    can (`launch_before_masks`: the decode graphs), its sampling once the masks are filled."""

    def __init__(self, runner: StepRunner) -> None:
        self.runner = runner
        # Whether the runner starts a step's forward before its masks (flare.engine.step.StepRunner).
        self.splits_steps = getattr(runner, "launch_before_masks", None) is not None

    def start(self, step: Scheduled, masked: tuple[int, ...]) -> Planned:
        """Launch a step without constrained rows whole; start a constrained one's forward where the runner
        can, and nothing of it otherwise."""
        plan = step.scheduled.plan
        if not masked:
            return Planned(step, masked, self.runner.launch(plan), None)
        later = self.runner.launch_before_masks(plan) if self.splits_steps else None
        return Planned(step, masked, None, later)

    def complete(self, planned: Planned, masks: np.ndarray | None) -> Launched:
        """Launch what the planned step still lacks: its sampling with `masks` (or the whole step)."""
        pending = planned.pending
        if pending is None:
            if planned.later is not None:
                pending = planned.later.sample_with(planned.masked, masks)
            else:
                pending = self.runner.launch(with_token_masks(planned.plan, planned.masked, masks))
        step = planned.step
        return Launched(planned.plan, planned.requests, pending, planned.runs_ahead, step.offered,
                        bool(planned.masked))
