"""A fake model runner for engine tests: checks the page tables, samples a function of the context."""

from __future__ import annotations

from flare.engine.kv_cache import PageAllocator
from flare.engine.scheduler import RunnerOutput, SchedulerOutput


class FakeRunner:
    """Stands in for the model: writes each computed token into a fake KV store at its page slot, and
    samples a token that depends on the whole context as read back from the pages. A wrong page
    table, a page shared while written, or a lost token changes the output or raises."""

    vocab_size = 97

    def __init__(self) -> None:
        self.slots: dict[int, int] = {}
        self.steps: list[SchedulerOutput] = []

    def execute(self, scheduled: SchedulerOutput, allocator: PageAllocator) -> RunnerOutput:
        self.steps.append(scheduled)
        sampled = {}
        for chunk in scheduled.chunks:
            request = chunk.request
            table = allocator.page_table(request.request_id)
            for position in range(chunk.start, chunk.start + chunk.num_new_tokens):
                slot = table[position // allocator.page_size] * allocator.page_size + position % allocator.page_size
                token = request.all_token_ids[position]
                if allocator._refcounts[table[position // allocator.page_size]] > 1 and self.slots.get(slot) != token:
                    raise AssertionError(f"{request.request_id} overwrote a shared page at position {position}")
                self.slots[slot] = token
            if chunk.completes:
                context = [self.slots[table[p // allocator.page_size] * allocator.page_size + p % allocator.page_size]
                           for p in range(request.num_tokens)]
                assert context == request.all_token_ids, f"{request.request_id}: the pages lost the context"
                sampled[request.request_id] = next_token(context)
        return RunnerOutput(sampled)


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
