"""How many drafts a step verifies: chosen per step from measured acceptance and measured step cost.

A step with B decoding requests at verification width W (1 + W - 1 drafts each) costs c(B, W) seconds
and brings each request 1 + s_1 + ... + s_{W-1} tokens in expectation, s_j being the probability that
its first j drafts all survive (the product of the measured conditional acceptance rates at positions
1..j). Adaptive selection picks the W that maximises B * tokens(W) / c(B, W); the spec's alpha scores
each survival probability as s_j ** alpha (alpha below 1 favours longer prefixes, above 1 shorter).
Fixed selection always verifies the most drafts allowed.

Both halves are measured while serving: acceptance from every verified round (exponentially weighted,
so a change of workload is followed), cost from the wall time of every speculative step, kept per
(batch bucket, width). A width not measured yet at a bucket is priced from the bucket's measured widths
by a row-count model (a step's cost grows little with its rows while the weights' read dominates), and
every `EXPLORE_EVERY`-th step tries the least measured width next to the best, so the estimates stay
current.

The widths a batch may use are the catalog's (flare.speculation_plan): with B requests, rounded up to
the batch capacity b that holds them (`buckets`, the decode capacities), each W with b * W within
`max_rows` (the speculative token capacity, or `--mtp-max-verification-token-budget` below it); with
`exact_rows` (`--mtp-verification-token-budget`) only the W of b * W = exact_rows (rounded down), beside
width one.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass, field

DECAY = 0.05                # weight of the newest observation in the moving averages
EXPLORE_EVERY = 16          # every this many speculative steps, measure a neighbouring width
PRIOR_ACCEPTANCE = 0.6      # conditional acceptance assumed before any round at a position
PRIOR_ROW_COST = 0.01       # relative cost of one more target row, before any measurement
BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512)


@dataclass
class _Average:
    value: float
    count: int = 0

    def add(self, sample: float) -> None:
        self.count += 1
        weight = max(DECAY, 1.0 / self.count)
        self.value += weight * (sample - self.value)


@dataclass
class VerificationWidth:
    """`max_drafts`: the most drafts a request carries (D); widths run 1 .. D + 1."""

    max_drafts: int
    adaptive: bool = True
    alpha: float = 1.0
    max_rows: int | None = None
    exact_rows: int | None = None
    buckets: tuple[int, ...] = BUCKETS
    acceptance: list[_Average] = field(default_factory=list)
    costs: dict[tuple[int, int], _Average] = field(default_factory=dict)
    steps: int = 0

    def __post_init__(self) -> None:
        self.acceptance = [_Average(PRIOR_ACCEPTANCE) for _ in range(self.max_drafts)]

    def drafts_for(self, batch: int) -> int:
        """Drafts per request for a step with `batch` requests that may carry them."""
        allowed = self._widths(batch)
        if batch == 0 or allowed == [1]:
            return 0
        if not self.adaptive:
            return allowed[-1] - 1
        self.steps += 1
        bucket = self._bucket(batch)
        best = max(allowed, key=lambda width: batch * self._tokens(width) / self._cost(bucket, width))
        if self.steps % EXPLORE_EVERY == 0:
            at = allowed.index(best)
            neighbours = allowed[max(0, at - 1):at] + allowed[at + 1:at + 2]
            best = min(neighbours, key=lambda w: self._measured(bucket, w), default=best)
        return best - 1

    def observe_round(self, num_drafts: int, num_accepted: int) -> None:
        """One request's verified round: drafts 1..num_accepted survived, draft num_accepted + 1 did not."""
        for position in range(min(num_drafts, self.max_drafts)):
            if position < num_accepted:
                self.acceptance[position].add(1.0)
            else:
                self.acceptance[position].add(0.0)
                break

    def observe_step(self, batch: int, drafts: int, seconds: float) -> None:
        """The wall time of a step whose `batch` decoding requests were offered `drafts` drafts each."""
        if batch and seconds > 0:
            key = (self._bucket(batch), drafts + 1)
            self.costs.setdefault(key, _Average(seconds)).add(seconds)

    # ---- internals -------------------------------------------------------------------------------

    def _widths(self, batch: int) -> list[int]:
        """The widths the catalog holds for this batch, width one first."""
        bucket = self._bucket(batch)
        most = self.max_drafts + 1
        if self.max_rows is not None:
            most = min(most, self.max_rows // bucket)
        if self.exact_rows is not None:
            exact = min(most, self.exact_rows // bucket)
            return [1, exact] if exact > 1 else [1]
        return list(range(1, max(1, most) + 1))

    def _bucket(self, batch: int) -> int:
        index = bisect.bisect_left(self.buckets, batch)
        return self.buckets[min(index, len(self.buckets) - 1)]

    def _tokens(self, width: int) -> float:
        """Expected tokens a request gets from a round of this width."""
        total, survival = 1.0, 1.0
        for position in range(width - 1):
            survival *= min(1.0, max(0.0, self.acceptance[position].value))
            total += survival ** self.alpha
        return total

    def _measured(self, bucket: int, width: int) -> int:
        found = self.costs.get((bucket, width))
        return found.count if found else 0

    def _cost(self, bucket: int, width: int) -> float:
        found = self.costs.get((bucket, width))
        if found is not None:
            return found.value
        measured = [(w, avg.value) for (b, w), avg in self.costs.items() if b == bucket]
        if not measured:
            return 1.0 + PRIOR_ROW_COST * bucket * (width - 1)
        nearest, cost = min(measured, key=lambda item: abs(item[0] - width))
        rows, nearest_rows = bucket * width, bucket * nearest
        return cost * (1.0 + PRIOR_ROW_COST * rows) / (1.0 + PRIOR_ROW_COST * nearest_rows)
