"""The scheduler -> runner contract (flare.engine.step) on the fake runner: new requests cross once, then
only deltas; batch slots; draft tokens with some accepted; token masks passed to the sampler."""

from __future__ import annotations

import numpy as np
import pytest
from fake_runner import FakeRunner, fake_continuation, next_token
from test_scheduler import add, prompt, run_to_end

from flare.engine.config import EngineConfig
from flare.engine.speculation.settings import SpeculationSettings
from flare.engine.core import EngineCore


def run_checked(core: EngineCore, max_steps: int = 10_000) -> dict[str, list[int]]:
    """run_to_end, checking after every step that the runner's page tables, built from deltas alone,
    are the allocator's."""
    tokens: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not core.has_unfinished():
            return tokens
        for output in core.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
        core.check_integrity()
        core.runner.check_tables(core)
    raise AssertionError("the engine did not finish")


@pytest.mark.parametrize("one_step_ahead", [False, True])
def test_a_request_crosses_once_and_then_only_its_new_pages(make_fake_core, one_step_ahead):
    core = make_fake_core(page_size=4, num_pages=64, max_model_len=64, one_step_ahead=one_step_ahead)
    add(core, "a", prompt(10), max_tokens=12)
    add(core, "b", prompt(5, 1), max_tokens=12)
    tokens = run_checked(core)
    assert tokens == {"a": fake_continuation(prompt(10), 12), "b": fake_continuation(prompt(5, 1), 12)}
    steps = core.runner.steps
    assert [n.request_id for s in steps for n in s.new_requests] == ["a", "b"]
    [first] = [n for n in steps[0].new_requests if n.request_id == "a"]
    assert first.prompt_token_ids == tuple(prompt(10)) and first.output_token_ids == ()
    sent = {}
    for step in steps:
        for row in step.rows:
            sent.setdefault(row.request_id, []).extend(row.new_page_ids)
            # A page crosses only in the step whose tokens first need it.
            needed = -(-(row.num_computed_tokens + row.num_new_tokens) // 4)
            assert len(sent[row.request_id]) == needed
    assert len(sent["a"]) == -(-(10 + 11) // 4)             # the last token is sampled, never computed
    assert {row.slot for s in steps for row in s.rows if row.request_id == "a"} == {0}
    assert {row.slot for s in steps for row in s.rows if row.request_id == "b"} == {1}


def test_slots_are_reused_only_after_they_are_freed(make_fake_core):
    core = make_fake_core(max_concurrency=2, page_size=4, num_pages=64, max_model_len=64)
    for i in range(5):
        add(core, f"r{i}", prompt(4 + i, i), max_tokens=3 + i)
    tokens = run_checked(core)
    for i in range(5):
        assert tokens[f"r{i}"] == fake_continuation(prompt(4 + i, i), 3 + i)
    slots = {n.request_id: n.slot for s in core.runner.steps for n in s.new_requests}
    assert set(slots.values()) == {0, 1}
    freed = [rid for s in core.runner.steps for rid in s.finished_request_ids]
    # Each forgotten once (the fake refuses a slot reused before); the last to finish waits for a next plan.
    assert len(freed) == len(set(freed)) == 4 and set(freed) < set(slots)


def test_a_preempted_request_crosses_again_with_its_output(make_fake_core):
    core = make_fake_core(max_concurrency=4, page_size=2, num_pages=12, max_model_len=24, prefill_chunk=4,
                          max_num_batched_tokens=8)
    prompts = {f"r{i}": prompt(5, 10 * i) for i in range(4)}
    for request_id, ids in prompts.items():
        add(core, request_id, ids, max_tokens=12)
    tokens = run_checked(core)
    for request_id, ids in prompts.items():
        assert tokens[request_id] == fake_continuation(ids, 12)
    resumed = [(s, n) for s in core.runner.steps for n in s.new_requests if n.output_token_ids]
    assert resumed, "the test needs a request to resume after a preemption"
    for _, new in resumed:
        ids = prompts[new.request_id]
        assert new.prompt_token_ids == tuple(ids)
        assert list(new.output_token_ids) == fake_continuation(ids, len(new.output_token_ids))


class OracleDrafter:
    """Proposes `length` drafts: the fake model's true continuation, with every `wrong_every`-th draft
    step's second draft wrong, so the runner accepts all, some, or one of them."""

    def __init__(self, length: int, wrong_every: int) -> None:
        self.length, self.wrong_every, self.calls = length, wrong_every, 0

    def propose(self, request, max_tokens: int) -> tuple[int, ...]:
        self.calls += 1
        context = list(request.all_token_ids)
        drafts = []
        for i in range(min(self.length, max_tokens)):
            token = next_token(context)
            if i == 1 and self.calls % self.wrong_every == 0:
                token = (token + 1) % FakeRunner.vocab_size
            drafts.append(token)
            context.append(token)
        return tuple(drafts)


@pytest.mark.parametrize("enable_prefix_caching", [False, True])
def test_accepted_draft_tokens_commit_and_rejected_ones_roll_back(enable_prefix_caching):
    config = EngineConfig(max_concurrency=3, page_size=4, num_pages=64, max_model_len=64, prefill_chunk=8,
                          max_num_batched_tokens=32, enable_prefix_caching=enable_prefix_caching,
                          speculation=SpeculationSettings(draft_tokens=3))
    core = EngineCore(config, FakeRunner(config.page_size), drafter=OracleDrafter(length=3, wrong_every=2))
    prompts = {f"r{i}": prompt(6 + 3 * i, i) for i in range(3)}
    for request_id, ids in prompts.items():
        add(core, request_id, ids, max_tokens=20)
    tokens = run_checked(core)
    for request_id, ids in prompts.items():
        assert tokens[request_id] == fake_continuation(ids, 20)
    drafted = [row for s in core.runner.steps for row in s.rows if row.draft_token_ids]
    assert drafted and max(len(row.draft_token_ids) for row in drafted) == 3
    decode_steps = [s for s in core.runner.steps if all(r.num_fed_tokens == 1 for r in s.rows)]
    assert len(decode_steps) < 19, "accepted drafts bring several tokens a step"
    # Every computed token counted once: prompts and outputs but each request's last one.
    assert core.stats().num_computed_tokens == sum(len(ids) + 19 for ids in prompts.values())


def test_drafts_stay_within_the_length_limits():
    config = EngineConfig(page_size=4, num_pages=16, max_model_len=16, speculation=SpeculationSettings(draft_tokens=4))
    core = EngineCore(config, FakeRunner(config.page_size), drafter=OracleDrafter(length=4, wrong_every=1000))
    add(core, "short", prompt(3), max_tokens=5)
    add(core, "long", prompt(9, 1), max_tokens=50)
    tokens = run_checked(core)
    assert tokens["short"] == fake_continuation(prompt(3), 5)
    assert tokens["long"] == fake_continuation(prompt(9, 1), 16 - 9)
    for step in core.runner.steps:
        for row in step.rows:
            assert row.num_computed_tokens + row.num_new_tokens <= 16


class EvenTokens:
    """A grammar stand-in: request "constrained" may only sample even token ids."""

    def __init__(self, vocab_size: int) -> None:
        mask = np.zeros(-(-vocab_size // 32), dtype=np.uint32)
        for token in range(0, vocab_size, 2):
            mask[token // 32] |= np.uint32(1 << (token % 32))
        self.mask = mask.view(np.int32)
        self.asked = 0

    def constrains(self, request) -> bool:
        return request.request_id == "constrained"

    def next_token_masks(self, requests, unread) -> np.ndarray:
        self.asked += len(requests)
        return np.stack([self.mask] * len(requests))


def test_even_token_mask_layout():
    mask = EvenTokens(97).mask
    assert mask.shape == (4,) and mask.dtype == np.int32
    assert [(int(mask[t // 32]) >> (t % 32)) & 1 for t in range(6)] == [1, 0, 1, 0, 1, 0]


@pytest.mark.parametrize("one_step_ahead", [False, True])
def test_token_masks_reach_the_sampler_for_constrained_requests_only(one_step_ahead):
    config = EngineConfig(page_size=4, num_pages=64, max_model_len=64, one_step_ahead=one_step_ahead)
    masker = EvenTokens(FakeRunner.vocab_size)
    core = EngineCore(config, FakeRunner(config.page_size), token_masker=masker)
    add(core, "constrained", prompt(7), max_tokens=15)
    add(core, "free", prompt(7), max_tokens=15)
    tokens = run_checked(core)
    assert tokens["free"] == fake_continuation(prompt(7), 15)
    assert all(t % 2 == 0 for t in tokens["constrained"]) and tokens["constrained"] != tokens["free"]
    masked = [row for s in core.runner.steps for row in s.rows if row.token_mask is not None]
    assert {row.request_id for row in masked} == {"constrained"} and len(masked) == masker.asked == 15
    assert all(row.samples for row in masked)


@pytest.mark.parametrize("one_step_ahead", [False, True])
def test_a_masked_step_is_planned_while_the_step_before_runs(one_step_ahead):
    """The mask of step N+1 needs token N: one step ahead, the core plans N+1 before it reads N's ids, then
    fills the masks and launches (the device waits only for the masks); the tokens do not change."""
    from test_one_step_ahead import Ordered

    config = EngineConfig(page_size=4, num_pages=64, max_model_len=64, one_step_ahead=one_step_ahead)
    runner = Ordered(FakeRunner(config.page_size))
    core = EngineCore(config, runner, token_masker=EvenTokens(FakeRunner.vocab_size))
    schedule = core.scheduler.schedule
    core.scheduler.schedule = lambda: (runner.events.append(("plan", None)), schedule())[1]
    add(core, "constrained", prompt(7), max_tokens=15)
    tokens = run_checked(core)["constrained"]
    assert len(tokens) == 15 and all(t % 2 == 0 for t in tokens)
    events = runner.events
    overlapped = 0
    for i, (kind, number) in enumerate(events):
        if kind == "launch" and number > 0:
            planned = max(j for j in range(i) if events[j][0] == "plan")
            overlapped += planned < events.index(("result", number - 1)) < i
    assert overlapped == (14 if one_step_ahead else 0)      # every decode step after the first token
