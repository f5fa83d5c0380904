"""A fake model runner for engine tests: the step contract (flare.engine.step) without a model.

It keeps what a real runner keeps, from the plans' deltas only: a page table and the request's tokens
per batch slot (the ids it crossed with, then those the fake sampled itself). It writes each computed
token into a fake KV store at its page slot and samples a token that depends on the whole context as
read back from the pages. A wrong delta, a page shared while written, a token it was never told about
or a lost token changes the output or raises."""

from __future__ import annotations

from dataclasses import dataclass, field

from flare.engine.step import (DoneStep, PageTransfers, RetainedGeometry, ScheduledRow, StepPlan, StepResult,
                               TransferNews)

@dataclass
class Seat:
    request_id: str
    tokens: list[int]                                   # crossed ids, then sampled ones
    pages: list[int] = field(default_factory=list)


class FakeRunner:
    """Draft tokens are verified as speculation does: accepted while they equal the fake model's choice,
    then one sampled token. A token mask moves the choice to the next allowed token."""

    vocab_size = 97

    def __init__(self, page_size: int, retained_slots: int = 0, lag: int = 0) -> None:
        self.page_size = page_size
        self.kv: dict[int, int] = {}                    # cache slot -> token written there
        self.seats: dict[int, Seat] = {}                # batch slot -> its request
        self.steps: list[StepPlan] = []
        self.retention = FakeRetention(self, retained_slots, lag) if retained_slots else None

    def retained_geometry(self):
        return self.retention.geometry() if self.retention is not None else None

    def transfer_news(self, wait_s: float = 0.0) -> TransferNews:
        return self.retention.news() if self.retention is not None else TransferNews()

    def close_retention(self, deadline_s: float) -> None:
        pass

    def samples_ahead(self, params) -> bool:
        return True

    def reset(self) -> None:
        self.seats.clear()

    def launch(self, plan: StepPlan) -> DoneStep:
        self.steps.append(plan)
        if plan.transfers is not None:
            self.retention.apply(plan.transfers)
        for request_id in (*plan.preempted_request_ids, *plan.finished_request_ids):
            for slot in [s for s, seat in self.seats.items() if seat.request_id == request_id]:
                del self.seats[slot]
        for new in plan.new_requests:
            assert new.slot not in self.seats, f"slot {new.slot} reused before it was freed"
            self.seats[new.slot] = Seat(new.request_id, [*new.prompt_token_ids, *new.output_token_ids])
        return DoneStep(StepResult(tuple(self._run(row) for row in plan.rows)))

    def _run(self, row: ScheduledRow) -> tuple[int, ...]:
        seat = self.seats[row.slot]
        assert seat.request_id == row.request_id, f"slot {row.slot} holds {seat.request_id}, not {row.request_id}"
        seat.pages += row.new_page_ids
        start, end = row.num_computed_tokens, row.num_computed_tokens + row.num_new_tokens
        fed_end = start + row.num_fed_tokens
        assert fed_end <= len(seat.tokens), f"{row.request_id}: asked to feed tokens the runner never had"
        fed = seat.tokens[start:fed_end] + list(row.draft_token_ids)
        for position, token in zip(range(start, end), fed):
            self._write(seat, position, token)
        if not row.samples:
            return ()
        assert fed_end == len(seat.tokens), f"{row.request_id}: samples before its last token"
        context = [self.kv[self._slot(seat, p)] for p in range(fed_end)]
        assert context == seat.tokens, f"{row.request_id}: the pages lost the context"
        chosen = []
        for position in range(row.num_fed_tokens - 1, row.num_new_tokens):
            token = masked_choice(next_token(context + chosen), row.token_mask, len(chosen))
            chosen.append(token)
            draft = position + 1 - row.num_fed_tokens       # the draft fed after this position
            if draft >= len(row.draft_token_ids) or row.draft_token_ids[draft] != token:
                break
        seat.tokens += chosen
        return tuple(chosen)

    def _slot(self, seat: Seat, position: int) -> int:
        return seat.pages[position // self.page_size] * self.page_size + position % self.page_size

    def _write(self, seat: Seat, position: int, token: int) -> None:
        slot = self._slot(seat, position)
        page = seat.pages[position // self.page_size]
        shared = any(page in other.pages for other in self.seats.values() if other is not seat)
        if shared and self.kv.get(slot) != token:
            raise AssertionError(f"{seat.request_id} overwrote a shared page at position {position}")
        self.kv[slot] = token

    def check_tables(self, core) -> None:
        """Every running request's slot holds its pages, as the allocator has them (test-side check)."""
        for request in core.scheduler.running:
            if request.seated:
                assert self.seats[request.slot].pages == core.allocator.page_table(request.request_id)


class FakeRetention:
    """The runner side of prefix retention for the fake: a host slot or disk file holds a page's tokens
    (None where a position was never written). Loads and reads are reported `lag` news calls late;
    `damaged` keys fail their disk read; `unwritable` makes every disk write fail."""

    def __init__(self, runner: FakeRunner, slots: int, lag: int) -> None:
        self.runner, self.slots, self.lag = runner, slots, lag
        self.host: dict[int, list] = {}
        self.disk: dict[bytes, list] = {}
        self.damaged: set[bytes] = set()
        self.unwritable = False
        self._pending: list[list] = []                  # [calls left, ticket, failed keys]
        self.applied: list[PageTransfers] = []

    def geometry(self) -> RetainedGeometry:
        return RetainedGeometry(self.slots, 1, 1, tuple(self.disk))

    def page(self, page: int) -> list:
        size = self.runner.page_size
        return [self.runner.kv.get(page * size + offset) for offset in range(size)]

    def apply(self, transfers: PageTransfers) -> None:
        self.applied.append(transfers)
        size = self.runner.page_size
        for copy in transfers.saves:
            self.host[copy.slot] = self.page(copy.page)
        for load in transfers.loads:
            for copy in load.copies:
                for offset, token in enumerate(self.host[copy.slot]):
                    self.runner.kv[copy.page * size + offset] = token
            self._pending.append([self.lag, load.ticket, []])
        for key in transfers.discards:
            self.disk.pop(key, None)
        self._finish(transfers.writes, self._write)
        self._finish(transfers.reads, self._read)
        self._finish(transfers.pool_writes, lambda order: True)
        self._finish(transfers.pool_reads, lambda order: False)       # the fake has no pool: it lacks them

    def _finish(self, orders, job) -> None:
        tickets: dict[int, list] = {}
        for order in orders:
            failed = tickets.setdefault(order.ticket, [])
            if not job(order):
                failed.append(order.key)
        self._pending += [[self.lag, ticket, failed] for ticket, failed in tickets.items()]

    def _write(self, order) -> bool:
        if self.unwritable:
            return False
        self.disk[order.key] = list(self.host[order.slot])
        return True

    def _read(self, order) -> bool:
        if order.key in self.damaged or order.key not in self.disk:
            return False
        self.host[order.slot] = list(self.disk[order.key])
        return True

    def news(self) -> TransferNews:
        done, failed, still = [], [], []
        for item in self._pending:
            if item[0] <= 0:
                done.append(item[1])
                failed += [(item[1], key) for key in item[2]]
            else:
                item[0] -= 1
                still.append(item)
        self._pending = still
        return TransferNews(tuple(done), tuple(failed))


def masked_choice(token: int, token_mask, index: int) -> int:
    """`token` if the mask allows it, else the next allowed one after it (wrapping)."""
    if token_mask is None:
        return token
    words = token_mask[index]
    for offset in range(FakeRunner.vocab_size):
        candidate = (token + offset) % FakeRunner.vocab_size
        if (int(words[candidate // 32]) >> (candidate % 32)) & 1:
            return candidate
    raise AssertionError("the token mask allows nothing")


def next_token(context: list[int]) -> int:
    """The fake model's deterministic choice: a function of the whole context."""
    value = 0
    for token in context:
        value = (value * 31 + token + 1) % 1_000_003
    return value % FakeRunner.vocab_size


def fake_continuation(prompt: list[int], max_tokens: int) -> list[int]:
    context = list(prompt)
    for _ in range(max_tokens):
        context.append(next_token(context))
    return context[len(prompt):]
