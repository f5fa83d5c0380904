"""Scheduler policy (spec §3.2): how much prefill a step may carry, and what retiring a request is worth.

Two policies share one queue discipline (first come, first served; the head of the queue is never
skipped) and differ only in how much prompt work a step may carry next to the decoding requests:

* `balanced` (the default) keeps output cadence: while any request is decoding, a step carries at
  most one prefill chunk (`prefill_chunk` tokens) of prompt work, so a long prompt arriving never
  stretches the gap between two tokens of a running request by more than one chunk. With nobody
  decoding there is no cadence to keep, and prefill takes the whole step budget.
* `throughput` lets prompt work fill the whole step budget (`max_num_batched_tokens`) every step:
  fewer, larger steps, and longer gaps between output bursts. Requests are still served oldest
  first, so token service stays fair and nobody starves.

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
from dataclasses import dataclass
from typing import Literal

from flare.errors import UsageError

SCHEDULER_POLICIES = ("balanced", "throughput")
SchedulerPolicyName = Literal["balanced", "throughput"]

DEFAULT_TERMINAL_VALUE = 256.0       # prompt-token units
DEFAULT_TERMINAL_AGE_PRICE = 1.0     # value per ms²


@dataclass(frozen=True)
class SchedulerPolicy:
    name: SchedulerPolicyName = "balanced"
    terminal_value: float = DEFAULT_TERMINAL_VALUE
    terminal_age_price: float = DEFAULT_TERMINAL_AGE_PRICE

    def __post_init__(self) -> None:
        if self.name not in SCHEDULER_POLICIES:
            raise UsageError(f"--scheduler-policy {self.name}: choose one of {', '.join(SCHEDULER_POLICIES)}")
        for flag, value in (("--scheduler-terminal-value", self.terminal_value),
                            ("--scheduler-terminal-age-price", self.terminal_age_price)):
            if isinstance(value, bool) or not isinstance(value, (int, float)):
                raise UsageError(f"{flag} {value!r}: write a number")
            if not math.isfinite(value) or value < 0:
                raise UsageError(f"{flag} {value}: the value must be finite and non-negative (0 disables it)")

    def prefill_cap(self, step_budget: int, prefill_chunk: int, anyone_decoding: bool) -> int:
        """Most prompt tokens (all requests together) one step may carry before terminal allowances."""
        if self.name == "balanced" and anyone_decoding:
            return min(prefill_chunk, step_budget)
        return step_budget

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
