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

Plain decoding has a cost of its own to beat: a step without drafts may be planned before the previous
step's ids arrive (one step ahead, the host's work hidden behind the device's), while a drafted step
cannot, since its drafts follow from those ids. So width one is priced at the measured seconds per step
of plain decoding run ahead (`observe_ahead`) once both kinds are measured at a bucket, and the expected
tokens of a wider round count only the share of requests that carried drafts (`observe_coverage`:
history drafts find a continuation for some requests only). While plain decoding wins, steps run ahead
(`runs_ahead`); after `interval` of them in a row one step is read before the next is planned, and the
next step is a trial round at the best wider width. A trial that loses doubles the interval (up to
`LONGEST_RUN_AHEAD` steps); one that wins ends the run. Every cost is the wall time between two
consecutive steps' answers (host and device together), for plain and drafted steps alike.

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
FIRST_RUN_AHEAD = 16        # steps of plain decoding run ahead before drafts are tried again
LONGEST_RUN_AHEAD = 512     # the most, after trials that lost to plain decoding
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
    ahead_costs: dict[int, _Average] = field(default_factory=dict)    # bucket -> seconds per plain step run ahead
    coverage: _Average = field(default_factory=lambda: _Average(1.0))  # share of offered requests with drafts
    steps: int = 0
    interval: int = FIRST_RUN_AHEAD     # plain steps run ahead before the next trial of drafts
    _run: int = 0                       # plain steps run ahead in a row so far
    _trial: bool = False                # the next drafted step tries drafts whatever plain decoding costs
    _judging: bool = False              # the step after a trial: its choice judges the trial

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
        trial, self._trial = self._trial, False
        choices = allowed[1:] if trial else allowed
        best = max(choices, key=lambda width: batch * self._tokens(width) / self._price(bucket, width))
        if trial:
            self._judging = True
        elif self.steps % EXPLORE_EVERY == 0:
            if best > 1 and bucket not in self.ahead_costs:
                best = 1                        # plain decoding run ahead, not measured here yet
            else:
                at = allowed.index(best)
                neighbours = allowed[max(0, at - 1):at] + allowed[at + 1:at + 2]
                best = min(neighbours, key=lambda w: self._measured(bucket, w), default=best)
        elif self._judging:
            self._judging = False
            self.interval = min(2 * self.interval, LONGEST_RUN_AHEAD) if best == 1 else FIRST_RUN_AHEAD
        if best > 1:
            self._run = 0
        return best - 1

    def runs_ahead(self, batch: int) -> bool:
        """Whether a step that carries no drafts, with `batch` requests decoding, may be planned ahead of
        the previous step's ids (see the module's docstring): never under fixed selection, where every step
        offers drafts; always where the catalog allows no drafts at this batch."""
        if self._widths(batch) == [1]:
            return True
        if not self.adaptive or batch == 0:
            return False
        self._run += 1
        if self._run > self.interval:
            self._run = 0
            self._trial = True
            return False
        return True

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

    def observe_ahead(self, batch: int, seconds: float) -> None:
        """The wall time of a step of plain decoding run ahead, with `batch` requests decoding."""
        if batch and seconds > 0:
            self.ahead_costs.setdefault(self._bucket(batch), _Average(seconds)).add(seconds)

    def observe_coverage(self, offered: int, drafted: int) -> None:
        """A step offered drafts to `offered` requests, and `drafted` of them carried some."""
        if offered:
            self.coverage.add(drafted / offered)

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
        total, survival = 0.0, 1.0
        for position in range(width - 1):
            survival *= min(1.0, max(0.0, self.acceptance[position].value))
            total += survival ** self.alpha
        return 1.0 + self.coverage.value * total

    def _price(self, bucket: int, width: int) -> float:
        """A step's cost at this width: plain decoding run ahead for width one where both it and a step
        read before the next plan are measured here (their seconds compare), else `_cost`."""
        ahead = self.ahead_costs.get(bucket)
        if width == 1 and ahead is not None and any(b == bucket for b, _ in self.costs):
            return ahead.value
        return self._cost(bucket, width)

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
