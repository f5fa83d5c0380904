"""benchmarks/schedule_sim.py prices the real scheduler's steps with a step-cost table: its clock must
add exactly the table's prices, so that what it predicts for a policy is the table's consequence."""

from __future__ import annotations

import pytest
from benchmark_scripts import benchmark_module

from flare.engine.step_cost import StepCosts


@pytest.fixture(scope="module")
def sim():
    with benchmark_module("schedule_sim") as module:
        yield module


# Decodes alone: 5 ms at 1, 8 ms at 64; any prompt work costs 40 ms up to 512 tokens, 60 ms at 2,048.
COSTS = StepCosts("test GPU", 1024, (1, 64), (0, 512, 2048), ((5.0, 40.0, 60.0), (8.0, 40.0, 60.0)))


def options(**changes):
    args = dict(page_size=16, num_pages=4096, prefill_chunk=2048, max_model_len=4096)
    args.update(changes)
    return type("Args", (), args)


def test_one_request_pays_its_prompt_step_then_the_decode_price_per_token(sim):
    policy = sim.policy_for("balanced", COSTS, 64)
    row = sim.simulate(COSTS, policy, sim.Load(concurrency=1, requests=2, input_len=1000, output_len=11), options())
    assert row["ttft_ms"]["p50"] == pytest.approx(COSTS.step_ms(0, 1000))
    assert row["tpot_ms"]["p50"] == pytest.approx(5.0)
    assert row["duration_s"] == pytest.approx(2 * (COSTS.step_ms(0, 1000) + 10 * 5.0) / 1000)


def test_where_no_prompt_step_keeps_the_bound_balanced_moves_whole_chunks_and_the_old_floor_did_not(sim):
    load = sim.Load(concurrency=8, requests=16, input_len=1000, output_len=32)
    balanced = sim.simulate(COSTS, sim.policy_for("balanced", COSTS, 64), load, options())
    floor = sim.simulate(COSTS, sim.policy_for("floor256", COSTS, 64), load, options())
    # The bound is 2 x 8 ms: every step with prompt work breaks it. One chunk per step finishes sooner.
    assert balanced["steps"] < floor["steps"]
    assert balanced["output_tokens_per_s"] > floor["output_tokens_per_s"]
    assert balanced["ttft_ms"]["p99"] < floor["ttft_ms"]["p99"]


def test_an_unknown_policy_is_refused_by_name(sim):
    with pytest.raises(SystemExit, match="unknown policy 'fastest'"):
        sim.policy_for("fastest", COSTS, 64)
