"""Scheduler policies on fake model outputs: prefill caps, fairness, terminal retirement value, validation."""

from __future__ import annotations

import math

import pytest
from fake_runner import FakeRunner, fake_continuation
from test_scheduler import add, prompt, run_to_end

from flare.engine.config import EngineConfig
from flare.engine.core import EngineCore
from flare.engine.policy import SchedulerPolicy, parse_scheduler_number
from flare.errors import UsageError

NO_TERMINAL_VALUE = SchedulerPolicy(terminal_value=0, terminal_age_price=0)


def make_core(policy: SchedulerPolicy, clock=None, **settings) -> EngineCore:
    config = EngineConfig(scheduler_policy=policy, **settings)
    core = EngineCore(config, FakeRunner(config.page_size))
    if clock is not None:
        core.scheduler.clock = clock
    return core


@pytest.mark.parametrize("policy", ["balanced", "throughput"])
def test_a_mixed_workload_finishes_with_nobody_starved(policy):
    # Long prompts, short prompts and long generations arriving together and over time.
    core = make_core(SchedulerPolicy(policy), max_concurrency=4, page_size=4, num_pages=64, max_model_len=128,
                     prefill_chunk=8, max_num_batched_tokens=24)
    workload = {}
    for i in range(12):
        kind = i % 3
        ids = prompt([60, 5, 10][kind], i)
        workload[f"r{i}"] = (ids, [4, 4, 40][kind])
    first_token_step, admitted, tokens = {}, [], {}
    arrivals = list(workload.items())
    step = 0
    while arrivals or core.has_unfinished():
        if arrivals and step % 2 == 0:               # one arrival every other step
            request_id, (ids, max_tokens) = arrivals.pop(0)
            add(core, request_id, ids, max_tokens=max_tokens)
        for output in core.step():
            first_token_step.setdefault(output.request_id, step)
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
        for row in core.runner.steps[-1].rows if core.runner.steps else ():
            if row.request_id not in admitted:
                admitted.append(row.request_id)
        core.check_integrity()
        step += 1
        assert step < 1000, "the workload did not finish"
    assert admitted == list(workload), "admission is first come, first served"
    for request_id, (ids, max_tokens) in workload.items():
        assert tokens[request_id] == fake_continuation(ids, max_tokens), f"{request_id} did not finish right"
    for s in core.runner.steps:
        assert s.num_batched_tokens <= 24
    # The earliest arrival, a 60-token prompt, answers within its own prefill time (8 tokens a step).
    assert first_token_step["r0"] <= math.ceil(60 / 8)


def test_balanced_keeps_cadence_and_throughput_fills_the_step():
    # One step at a time, so the decoder's first token comes back from the step that computed it.
    settings = dict(max_concurrency=4, page_size=4, num_pages=64, max_model_len=128, prefill_chunk=8,
                    max_num_batched_tokens=32, one_step_ahead=False)
    caps = {}
    for name in ("balanced", "throughput"):
        core = make_core(SchedulerPolicy(name), **settings)
        add(core, "decoder", prompt(3), max_tokens=30)
        [first] = core.step()                        # the decoder's prompt; it decodes from now on
        for i in range(3):
            add(core, f"long{i}", prompt(40, i + 1), max_tokens=2)
        steps_before = len(core.runner.steps)
        outputs = run_to_end(core)
        assert list(first.new_token_ids) + outputs["decoder"] == fake_continuation(prompt(3), 30)
        later = core.runner.steps[steps_before:]
        prompt_length = {"decoder": 3, **{f"long{i}": 40 for i in range(3)}}
        caps[name] = max(sum(r.num_new_tokens for r in s.rows if r.num_computed_tokens < prompt_length[r.request_id])
                         for s in later)
        # The decoder gets a token in every step until it finishes, under both policies.
        decoder_steps = [any(r.request_id == "decoder" for r in s.rows) for s in later]
        assert decoder_steps == sorted(decoder_steps, reverse=True) and sum(decoder_steps) == 29
    assert caps["balanced"] <= 8 < caps["throughput"]


def test_balanced_prefills_with_the_whole_budget_when_nobody_decodes():
    core = make_core(SchedulerPolicy("balanced"), max_concurrency=4, page_size=4, num_pages=64, max_model_len=128,
                     prefill_chunk=8, max_num_batched_tokens=32)
    for i in range(4):
        add(core, f"r{i}", prompt(20, i), max_tokens=2)
    core.step()
    assert core.runner.steps[0].num_batched_tokens == 32


def retire_one_token_request(policy: SchedulerPolicy) -> tuple[int, dict[str, list[int]]]:
    """The step at which a one-token request queued behind a long prompt finishes, while another decodes."""
    core = make_core(policy, max_concurrency=4, page_size=4, num_pages=64, max_model_len=128, prefill_chunk=8,
                     max_num_batched_tokens=64, enable_prefix_caching=False)
    add(core, "decoder", prompt(3), max_tokens=30)
    core.step()
    add(core, "long", prompt(48, 1), max_tokens=4)
    add(core, "one", prompt(16, 2), max_tokens=1)
    finished_at, tokens, step = None, {}, 0
    while core.has_unfinished():
        for output in core.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
            if output.request_id == "one" and output.finish_reason:
                finished_at = step
        step += 1
    return finished_at, tokens


def test_terminal_value_retires_a_one_token_request_sooner():
    with_value, tokens = retire_one_token_request(SchedulerPolicy("balanced"))
    without, tokens_without = retire_one_token_request(NO_TERMINAL_VALUE)
    assert with_value < without
    assert tokens == tokens_without                  # a preference changes the order, never the tokens
    assert tokens["one"] == fake_continuation(prompt(16, 2), 1)
    assert tokens["long"] == fake_continuation(prompt(48, 1), 4)


def first_victim(policy: SchedulerPolicy) -> str:
    """Three running requests; the oldest needs a page while the newest is one token from the end."""
    core = make_core(policy, max_concurrency=3, page_size=2, num_pages=8, max_model_len=16, prefill_chunk=8,
                     max_num_batched_tokens=16, enable_prefix_caching=False)
    add(core, "oldest", prompt(5), max_tokens=8)
    add(core, "middle", prompt(4, 1), max_tokens=8)
    add(core, "terminal", prompt(3, 2), max_tokens=3)
    tokens = run_to_end(core)
    for request_id, ids, max_tokens in (("oldest", prompt(5), 8), ("middle", prompt(4, 1), 8),
                                        ("terminal", prompt(3, 2), 3)):
        assert tokens[request_id] == fake_continuation(ids, max_tokens)
    return next(rid for s in core.runner.steps for rid in s.preempted_request_ids)


def test_a_request_about_to_finish_is_not_the_preemption_victim():
    assert first_victim(NO_TERMINAL_VALUE) == "terminal"       # without the value: the newest goes
    assert first_victim(SchedulerPolicy()) == "middle"


def test_retirement_value_grows_with_terminal_age():
    policy = SchedulerPolicy(terminal_value=256, terminal_age_price=1)
    assert policy.retirement_value(None) == 0
    assert policy.retirement_value(0.0) == 256
    assert policy.retirement_value(0.010) == pytest.approx(256 + 100)      # 10 ms: 1 value/ms² × 100 ms²
    assert SchedulerPolicy(terminal_value=0, terminal_age_price=1).retirement_value(0.0) == 0
    assert SchedulerPolicy(terminal_value=5, terminal_age_price=0).retirement_value(10.0) == 5


def test_terminal_age_starts_when_termination_is_observed():
    now = [100.0]
    core = make_core(SchedulerPolicy(), clock=lambda: now[0], max_concurrency=2, page_size=4, num_pages=16,
                     max_model_len=64)
    add(core, "one", prompt(4), max_tokens=1)
    add(core, "three", prompt(4, 1), max_tokens=3)
    requests = dict(core.requests)
    assert requests["one"].terminal_since == 100.0 and requests["three"].terminal_since is None
    now[0] = 101.0
    core.step()                                      # both prompts; "one" finishes, "three" has 1 of 3 tokens
    now[0] = 102.0
    core.step()                                      # "three" has 2 of 3
    assert requests["three"].terminal_since is None
    now[0] = 103.0
    core.step()                                      # seen one token from the end
    assert requests["three"].terminal_since == 103.0


@pytest.mark.parametrize("field, flag", [("terminal_value", "--scheduler-terminal-value"),
                                         ("terminal_age_price", "--scheduler-terminal-age-price")])
@pytest.mark.parametrize("value", [-1, math.nan, math.inf, -math.inf])
def test_terminal_coefficients_must_be_finite_and_non_negative(field, flag, value):
    with pytest.raises(UsageError, match=flag):
        SchedulerPolicy(**{field: value})


def test_policy_names_and_command_line_numbers():
    with pytest.raises(UsageError, match="--scheduler-policy fastest: choose one of balanced, throughput"):
        SchedulerPolicy("fastest")
    assert SchedulerPolicy(terminal_value=0, terminal_age_price=0) == NO_TERMINAL_VALUE
    assert parse_scheduler_number("--scheduler-terminal-value", "0") == 0
    assert parse_scheduler_number("--scheduler-terminal-age-price", "2.5") == 2.5
    for text in ("-1", "nan", "inf", "lots"):
        with pytest.raises(UsageError, match="--scheduler-terminal-value"):
            parse_scheduler_number("--scheduler-terminal-value", text)
    with pytest.raises(UsageError, match="--scheduler-terminal-value"):
        SchedulerPolicy(terminal_value="256")
