"""Scheduler policy (spec §3.2): how much prefill a step carries, and what retiring a request is worth.

Two policies share one queue discipline (first come, first served; the head of the queue is never
skipped) and differ only in how much prompt work a step may carry next to the decoding requests:

* `balanced` (the default) keeps output cadence. With the step costs the package measured at export
  (`flare.engine.step_cost.StepCosts`) it keeps every step that carries decodes within a cadence bound,
  `max_step_ms`: beside n decoding requests it carries the most prompt tokens whose measured step
  still fits the bound. Where no measured step with prompt work fits it (every such step costs more
  than the bound beside these decodes), the bound cannot be kept whatever is carried, and carrying
  less would only add steps that each break it: such a step carries one prefill chunk, as without
  costs, so prompts keep moving at full speed and first tokens stay fast. The same holds where the
  bound can be kept only at a price: a step with prompt work pays a fixed cost, and where that cost
  fills most of the bound, the few prompt tokens that still fit would move prompts at a fraction of a
  chunk's rate (prompt tokens per ms of step) while every decode waits through each such step. Where
  the bound's step moves prompt tokens at less than `MIN_PROMPT_RATE_SHARE` of a chunk's rate, it
  carries the chunk. The bound defaults to
  `DEFAULT_CADENCE_FACTOR` times the measured step of a full decode batch (the served concurrency, no
  prompt work): as the batch grows the prompt share shrinks, and with few decoding the prompts take
  more. Without step costs (a package exported on the CPU, or
  served on another kind of device) a step carries at most one prefill chunk (`prefill_chunk` tokens)
  of prompt work while anyone decodes. With nobody decoding there is no cadence to keep, and prefill
  takes the whole step budget either way.
* `throughput` lets prompt work fill the whole step budget (`max_num_batched_tokens`) every step:
  fewer, larger steps, and longer gaps between output bursts. Requests are still served oldest
  first, so token service stays fair and nobody starves. It keeps no cadence bound.

Terminal retirement. A request is *terminal* once its next sampled token is certainly its last
(one token left under max_tokens or the context limit; a request asking for one token is terminal on
arrival). Its age runs from the step at which the scheduler first sees it terminal, through any time
it spends queued again after a preemption. Retiring it frees its pages and its concurrency slot, so
it is worth

    retirement value = terminal_value + terminal_age_price × (age in ms)²

in prompt-token units. Both policies use that value the same way, as a preference, never a deadline:

1. Terminal requests are served first within a step, highest value first.
2. A terminal request may exceed the policy's per-step prefill cap by its value in tokens (within
   the step budget and its own prefill chunk): a preempted request one token from the end
   recomputes its context in fewer steps, and a one-token request is answered sooner.
3. When pages run out, the victim is the request with the lowest value among those admitted after
   the one that needs room (newest first among equals), so a request about to finish is not thrown
   back to recompute everything for its last token.

A value of zero disables its term: with both at zero, terminal requests are treated like any other.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Literal

from flare.engine.step_cost import StepCosts
from flare.config import check_max_step_ms
from flare.errors import UsageError

SCHEDULER_POLICIES = ("balanced", "throughput")
SchedulerPolicyName = Literal["balanced", "throughput"]

DEFAULT_TERMINAL_VALUE = 256.0       # prompt-token units
DEFAULT_TERMINAL_AGE_PRICE = 1.0     # value per ms²
DEFAULT_CADENCE_FACTOR = 2.0         # the default bound: twice a full decode batch's step
MIN_PROMPT_RATE_SHARE = 0.5          # below this share of a chunk's prompt rate, the bound is not worth it
MAX_STEP_MS_FLAG = "--scheduler-max-step-ms"


@dataclass(frozen=True)
class SchedulerPolicy:
    name: SchedulerPolicyName = "balanced"
    terminal_value: float = DEFAULT_TERMINAL_VALUE
    terminal_age_price: float = DEFAULT_TERMINAL_AGE_PRICE
    # The cadence bound `balanced` keeps (ms per step that carries decodes) and the measured costs it is
    # kept with; both None: one prefill chunk beside decodes. `with_step_costs` sets them.
    max_step_ms: float | None = None
    step_costs: StepCosts | None = None

    def __post_init__(self) -> None:
        if self.name not in SCHEDULER_POLICIES:
            raise UsageError(f"--scheduler-policy {self.name}: choose one of {', '.join(SCHEDULER_POLICIES)}")
        for flag, value in (("--scheduler-terminal-value", self.terminal_value),
                            ("--scheduler-terminal-age-price", self.terminal_age_price)):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise UsageError(f"{flag} {value!r}: write a number")
            if not math.isfinite(value) or value < 0:
                raise UsageError(f"{flag} {value}: the value must be finite and non-negative (0 disables it)")
        bounded = self.max_step_ms is not None
        if bounded != (self.step_costs is not None) or (bounded and self.name != "balanced"):
            raise ValueError("a cadence bound and its step costs go together, on balanced (with_step_costs)")
        if self.max_step_ms is not None:
            check_max_step_ms(self.max_step_ms, MAX_STEP_MS_FLAG)

    def with_step_costs(self, costs: StepCosts, concurrency: int, max_step_ms: float | None = None,
                        origin: str = MAX_STEP_MS_FLAG) -> SchedulerPolicy:
        """This policy keeping a cadence bound with `costs`: `max_step_ms` (given by `origin`), or by
        default DEFAULT_CADENCE_FACTOR times the measured step of `concurrency` decodes. `throughput`
        keeps none and is returned as it is; a bound given for it is refused."""
        if self.name != "balanced":
            if max_step_ms is not None:
                raise UsageError(f"{origin}: a cadence bound applies to --scheduler-policy balanced; {self.name} "
                                 "keeps none (it lets prompt bursts through); remove one of the two")
            return self
        if max_step_ms is None:
            max_step_ms = round(DEFAULT_CADENCE_FACTOR * costs.step_ms(concurrency, 0), 1)
        return replace(self, max_step_ms=check_max_step_ms(max_step_ms, origin), step_costs=costs)

    @property
    def prices_context(self) -> bool:
        """Whether `prefill_cap` reads the decoding rows' mean context (a table with a long measurement)."""
        return self.name == "balanced" and self.step_costs is not None and self.step_costs.long_context > 0

    def prefill_cap(self, step_budget: int, prefill_chunk: int, num_decoding: int, mean_context: float = 0.0) -> int:
        """Most prompt tokens (all requests together) one step may carry beside `num_decoding` decoding
        requests (at `mean_context` tokens of context on average; 0: as measured), before terminal
        allowances."""
        if self.name == "throughput" or num_decoding == 0:
            return step_budget
        chunk = min(prefill_chunk, step_budget)
        if self.step_costs is None:     # no costs: one chunk
            return chunk
        costs = self.step_costs
        fits = min(step_budget, costs.prompt_tokens_within(num_decoding, self.max_step_ms, mean_context))
        measured_chunk = min(chunk, costs.prompt_tokens[-1])
        if fits == 0 or (fits < chunk and self._prompt_rate(num_decoding, fits, mean_context)
                         < MIN_PROMPT_RATE_SHARE * self._prompt_rate(num_decoding, measured_chunk, mean_context)):
            return chunk                # no step with prompt work keeps the bound, or only at a fraction of the rate
        return fits

    def _prompt_rate(self, num_decoding: int, prompt_tokens: int, mean_context: float) -> float:
        """Prompt tokens per ms of a measured step that carries them beside `num_decoding` decodes."""
        return prompt_tokens / self.step_costs.step_ms(num_decoding, prompt_tokens, mean_context)

    def retirement_value(self, terminal_age_s: float | None) -> float:
        """What retiring a request is worth now, in prompt tokens; 0 for a request that is not terminal."""
        if terminal_age_s is None:
            return 0.0
        age_ms = max(0.0, terminal_age_s) * 1000.0
        return self.terminal_value + self.terminal_age_price * age_ms * age_ms


def parse_scheduler_number(flag: str, text: str) -> float:
    """A command-line value of --scheduler-terminal-value or --scheduler-terminal-age-price."""
    try:
        value = float(text)
    except ValueError:
        raise UsageError(f"{flag} {text}: write a finite, non-negative number, e.g. {flag} 256") from None
    if not math.isfinite(value) or value < 0:
        raise UsageError(f"{flag} {text}: the value must be finite and non-negative (0 disables it)")
    return value


