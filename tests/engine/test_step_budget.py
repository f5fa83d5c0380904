"""The balanced policy's step budget from measured step costs: the prompt tokens it carries beside decodes
are the ones the cost table implies for its cadence bound; without a table it carries one prefill chunk,
as it always did; the bound is checked where it is given."""

from __future__ import annotations

import math

import pytest
from fake_runner import FakeRunner, fake_continuation
from test_scheduler import add, prompt, run_to_end

from flare.engine.config import EngineConfig
from flare.engine.core import EngineCore
from flare.engine.policy import DEFAULT_CADENCE_FACTOR, SchedulerPolicy
from flare.engine.step_cost import StepCosts
from flare.errors import UsageError

# Two measured batches (1 and 16 decoding requests) beside 0, 512 and 1,024 prompt tokens.
COSTS = StepCosts("NVIDIA H200", 1024, (1, 16), (0, 512, 1024), ((5.0, 10.0, 15.0), (8.0, 14.0, 20.0)))
BUDGET, CHUNK = 4112, 2048


def test_the_policy_carries_the_prompt_tokens_the_table_implies():
    policy = SchedulerPolicy().with_step_costs(COSTS, concurrency=16, max_step_ms=17.0)
    assert policy.max_step_ms == 17.0
    # 16 decodes: 14 ms with 512 prompt tokens, 20 ms with 1,024; 17 ms is halfway
    assert policy.prefill_cap(BUDGET, CHUNK, num_decoding=16) == 768
    # 1 decode: 10 ms at 512, 15 ms at 1,024: the last column is all that was measured, so 1,024
    assert policy.prefill_cap(BUDGET, CHUNK, num_decoding=1) == 1024
    # 8.5 decodes' row lies halfway between the measured ones: 6.5, 12, 17.5 ms
    assert COSTS.step_ms(8.5, 0) == pytest.approx(6.5) and COSTS.step_ms(8.5, 768) == pytest.approx(14.75)
    # 8 decodes, 7/15 of the way from 1 to 16: 11.87 ms at 512 and 17.33 ms at 1,024, so 13 ms carries 618
    assert SchedulerPolicy().with_step_costs(COSTS, 16, 13.0).prefill_cap(BUDGET, CHUNK, 8) == 618
    # beyond the measured batches the nearest row holds
    assert policy.prefill_cap(BUDGET, CHUNK, num_decoding=40) == 768
    assert policy.prefill_cap(700, CHUNK, num_decoding=16) == 700                 # within the step budget


def test_prompt_work_below_the_first_column_costs_what_that_column_did():
    # A step with prompt work pays a price decode-only steps do not: 64 prompt tokens cost the 512 column.
    assert COSTS.step_ms(16, 64) == COSTS.step_ms(16, 512) == 14.0
    assert COSTS.prompt_tokens_within(16, 13.9) == 0
    assert COSTS.prompt_tokens_within(16, 14.0) == 512


def test_where_no_prompt_step_keeps_the_bound_a_step_carries_one_chunk():
    """The bound cannot be kept beside these decodes whatever is carried; fewer tokens would only make
    more steps that each break it (the H200's table: every llama-8b step with prompt work took ~40 ms)."""
    policy = SchedulerPolicy().with_step_costs(COSTS, concurrency=16, max_step_ms=12.0)     # 16 decodes: 14 ms
    assert COSTS.prompt_tokens_within(16, 12.0) == 0
    assert policy.prefill_cap(BUDGET, CHUNK, num_decoding=16) == CHUNK
    assert policy.prefill_cap(BUDGET, CHUNK, num_decoding=1) == 512 + 512 * 2 // 5       # 1 decode: it fits
    assert policy.prefill_cap(1000, CHUNK, num_decoding=16) == 1000                      # within the budget


# The H200's llama-8b table of 2026-12-02 (ms; rows 1, 16, 64 decodes; columns 0-4,096 prompt tokens): a step
# with prompt work paid ~30 ms of fixed price, so the bound kept only ~100 prompt tokens beside 64 decodes.
FIXED_PRICE = StepCosts("NVIDIA H200", 1024, (1, 16, 64), (0, 64, 128, 256, 512, 1024, 2048, 4096), (
    (5.393, 48.514, 49.483, 49.526, 49.776, 50.119, 51.875, 110.727),
    (6.204, 36.339, 35.025, 35.13, 39.037, 41.571, 52.124, 110.171),
    (8.57, 33.805, 35.757, 35.993, 33.652, 30.693, 56.768, 110.091)))


def test_a_bound_kept_only_at_a_fraction_of_a_chunks_prompt_rate_gives_way_to_the_chunk():
    """Keeping 35.1 ms beside 64 decodes would carry ~100 prompt tokens a step (2.9 tokens per ms) where a
    chunk moves 2,048 in 56.8 ms (36 per ms): each decode would wait through 20 slow steps instead of one."""
    policy = SchedulerPolicy().with_step_costs(FIXED_PRICE, concurrency=64, max_step_ms=35.1)
    assert 64 < FIXED_PRICE.prompt_tokens_within(64, 35.1) < 128
    assert policy.prefill_cap(BUDGET, CHUNK, num_decoding=64) == CHUNK
    # Where the bound's step moves prompts at half a chunk's rate or more, the bound holds (COSTS: 16
    # decodes within 17 ms carry 768 tokens, 45 per ms, against 1,024 in 20 ms, 51 per ms).
    assert SchedulerPolicy().with_step_costs(COSTS, 16, 17.0).prefill_cap(BUDGET, CHUNK, 16) == 768


def test_nobody_decoding_or_throughput_fills_the_step_and_no_table_carries_one_chunk():
    bounded = SchedulerPolicy().with_step_costs(COSTS, concurrency=16, max_step_ms=12.0)
    assert bounded.prefill_cap(BUDGET, CHUNK, num_decoding=0) == BUDGET
    throughput = SchedulerPolicy("throughput")
    assert throughput.with_step_costs(COSTS, 16) is throughput
    assert throughput.prefill_cap(BUDGET, CHUNK, num_decoding=16) == BUDGET
    unmeasured = SchedulerPolicy()
    assert unmeasured.max_step_ms is None
    assert [unmeasured.prefill_cap(BUDGET, CHUNK, n) for n in (0, 1, 16)] == [BUDGET, CHUNK, CHUNK]


def test_the_default_bound_is_twice_a_full_decode_batchs_step():
    assert DEFAULT_CADENCE_FACTOR == 2.0
    assert SchedulerPolicy().with_step_costs(COSTS, concurrency=16).max_step_ms == 16.0
    assert SchedulerPolicy().with_step_costs(COSTS, concurrency=1).max_step_ms == 10.0


def test_a_bound_is_checked_and_belongs_to_balanced():
    from flare.config import check_max_step_ms

    for value in (0, -5.0, math.nan, math.inf, True, "25"):
        with pytest.raises(UsageError, match="--scheduler-max-step-ms"):
            check_max_step_ms(value, "--scheduler-max-step-ms")
    with pytest.raises(UsageError, match="scheduler.max_step_ms = 20: a cadence bound applies to --scheduler-policy balanced"):
        SchedulerPolicy("throughput").with_step_costs(COSTS, 16, 20.0, origin="scheduler.max_step_ms = 20")
    with pytest.raises(ValueError):
        SchedulerPolicy(max_step_ms=20.0)                                    # a bound with no costs to keep it
    with pytest.raises(ValueError):
        SchedulerPolicy(step_costs=COSTS)


def test_a_table_must_be_a_rising_grid_of_positive_times():
    for batches, tokens, times in [((0, 16), (0, 512), ((1, 2), (3, 4))), ((16, 1), (0, 512), ((1, 2), (3, 4))),
                                   ((1,), (64, 512), ((1, 2),)), ((1,), (0, 512), ((1, 2, 3),)),
                                   ((1,), (0, 512), ((1, math.nan),)), ((1,), (0, 512), ((0.0, 1.0),))]:
        with pytest.raises(ValueError, match="step costs"):
            StepCosts("GPU", 1024, batches, tokens, times)
    noisy = StepCosts("GPU", 1024, (1,), (0, 64, 128), ((5.0, 4.0, 6.0),))  # timing noise: 64 looked cheaper
    assert noisy.step_ms(1, 64) == 5.0 and noisy.prompt_tokens_within(1, 5.5) == 96


LONG = StepCosts("GPU", 1024, (1, 16), (0, 512, 1024), ((5.0, 10.0, 15.0), (8.0, 14.0, 20.0)),
                 long_context=4096, long_decode_ms=(5.3, 11.0))


def test_decodes_at_longer_contexts_cost_what_the_long_measurement_adds():
    """Decode attention reads every context token: past decode_context a step costs more, linearly
    through the decodes measured at long_context (interpolated between batches, like the grid)."""
    assert LONG.context_ms(1, 1024) == 0.0 and LONG.context_ms(1, 500) == 0.0
    assert LONG.context_ms(1, 4096) == pytest.approx(0.3)
    assert LONG.context_ms(16, 2560) == pytest.approx(1.5)                # half way: half of 11 - 8
    assert LONG.context_ms(16, 7168) == pytest.approx(6.0)                # beyond: the same slope on
    assert LONG.step_ms(16, 512, 4096) == pytest.approx(17.0)
    assert COSTS.context_ms(16, 100_000) == 0.0                           # no long measurement: as before
    assert LONG.prompt_tokens_within(16, 17.0) == 768
    assert LONG.prompt_tokens_within(16, 17.0, 2560) == 640               # 1.5 ms of the bound gone to context
    assert LONG.prompt_tokens_within(16, 14.0, 2560) == 0                 # no prompt step keeps it any more
    policy = SchedulerPolicy().with_step_costs(LONG, 16, 17.0)
    assert policy.prefill_cap(1024, 1024, 16) == 768
    assert policy.prefill_cap(1024, 1024, 16, mean_context=2560) == 640


def test_a_long_measurement_must_be_longer_and_one_per_batch():
    grid = ((5.0, 10.0, 15.0), (8.0, 14.0, 20.0))
    for context, times in [(1024, (5.3, 11.0)), (4096, (5.3,)), (0, (5.3, 11.0)), (4096, (5.3, math.inf))]:
        with pytest.raises(ValueError, match="step costs"):
            StepCosts("GPU", 1024, (1, 16), (0, 512, 1024), grid, long_context=context, long_decode_ms=times)


# ---- through the scheduler -----------------------------------------------------------------------------

SMALL_COSTS = StepCosts("GPU", 1024, (1, 4), (0, 256, 512, 1024), ((5.0, 6.0, 8.0, 12.0), (6.0, 7.0, 9.0, 13.0)))
NO_TERMINAL = dict(terminal_value=0, terminal_age_price=0)      # terminal allowances would add to the cap


def steps_beside_one_decoder(policy: SchedulerPolicy, prompts: int, decoder_prompt: int = 3) -> list[int]:
    """The prompt tokens of each step that carried one decoding request and prompt work: a decoder (its
    prompt `decoder_prompt` tokens) runs, then `prompts` 1,500-token prompts arrive."""
    config = EngineConfig(max_concurrency=4, page_size=16, num_pages=512, max_model_len=2048, prefill_chunk=512,
                          max_num_batched_tokens=1028, scheduler_policy=policy, one_step_ahead=False)
    core = EngineCore(config, FakeRunner(config.page_size))
    add(core, "decoder", prompt(decoder_prompt), max_tokens=60)
    core.step()
    while core.runner.steps[-1].rows[0].num_new_tokens > 1:         # the decoder's prompt, chunk by chunk
        core.step()
    long_prompts = {f"long{i}": prompt(1500, i + 1) for i in range(prompts)}
    for request_id, ids in long_prompts.items():
        add(core, request_id, ids, max_tokens=2)
    outputs = run_to_end(core)
    for request_id, ids in long_prompts.items():
        assert outputs[request_id] == fake_continuation(ids, 2)
    lengths = {"decoder": decoder_prompt, **{request_id: 1500 for request_id in long_prompts}}
    carried = []
    for step in core.runner.steps:
        decodes = sum(1 for r in step.rows if r.num_computed_tokens >= lengths[r.request_id])
        prompt_tokens = sum(r.num_new_tokens for r in step.rows if r.num_computed_tokens < lengths[r.request_id])
        if decodes == 1 and prompt_tokens:
            carried.append(prompt_tokens)
    return carried


def test_the_scheduler_carries_the_tables_prompt_tokens_and_without_a_table_one_chunk():
    # One decoder: 6 ms with 256 prompt tokens, 8 ms with 512; a 7 ms bound carries 384 a step.
    bounded = SchedulerPolicy(**NO_TERMINAL).with_step_costs(SMALL_COSTS, concurrency=4, max_step_ms=7.0)
    carried = steps_beside_one_decoder(bounded, prompts=1)
    assert carried[:-1] == [384] * 3 and carried[-1] == 1500 - 3 * 384
    assert steps_beside_one_decoder(SchedulerPolicy(**NO_TERMINAL), prompts=1) == [512, 512, 476]
    # 11 ms: 896 tokens a step, more than one request's chunk: two prompts share the step.
    wide = SchedulerPolicy(**NO_TERMINAL).with_step_costs(SMALL_COSTS, concurrency=4, max_step_ms=11.0)
    assert steps_beside_one_decoder(wide, prompts=2)[:2] == [896, 896]
    assert steps_beside_one_decoder(SchedulerPolicy(**NO_TERMINAL), prompts=2)[:2] == [512, 512]


def test_a_decoder_at_a_longer_context_leaves_less_of_the_bound_to_prompt_work():
    """The scheduler prices the decoding rows at their mean context: 0.5 ms a 1,000 tokens past the table's
    64 leaves a 7 ms bound ~6.5 ms beside a decoder at ~1,070 tokens, ~320 prompt tokens instead of 384,
    fewer as its context grows."""
    long = StepCosts("GPU", 64, SMALL_COSTS.decode_batches, SMALL_COSTS.prompt_tokens, SMALL_COSTS.milliseconds,
                     long_context=1064, long_decode_ms=(5.5, 6.5))
    bounded = SchedulerPolicy(**NO_TERMINAL).with_step_costs(long, concurrency=4, max_step_ms=7.0)
    assert steps_beside_one_decoder(bounded, prompts=1, decoder_prompt=3)[:3] == [384] * 3
    carried = steps_beside_one_decoder(bounded, prompts=1, decoder_prompt=1064)
    assert all(310 <= tokens <= 320 for tokens in carried[:4]), carried
    assert carried[:4] == sorted(carried[:4], reverse=True)


def test_the_engine_reports_its_cadence_bound():
    bounded = SchedulerPolicy().with_step_costs(SMALL_COSTS, concurrency=4, max_step_ms=7.0)
    for policy, expected in ((bounded, 7.0), (SchedulerPolicy(), 0.0)):
        config = EngineConfig(max_concurrency=4, scheduler_policy=policy)
        assert EngineCore(config, FakeRunner(config.page_size)).stats().max_step_ms == expected


# ---- measuring -------------------------------------------------------------------------------------------

def test_steps_are_timed_on_the_grid_through_the_runner_and_its_slots_freed(stories260k, monkeypatch):
    """On the CPU (export measures on a GPU, the same way): every grid point is one launch per repeat of a
    plan of that shape, decodes first, and the slots are free again afterwards."""
    import torch

    from flare.engine.factory import load_checkpoint_model
    from flare.engine.runner import ModelRunner
    from flare.engine.step_cost import decode_batch_rows, measure_step_costs, measurement_model_len, \
        prompt_token_columns

    assert decode_batch_rows(256) == (1, 4, 16, 64, 256) and decode_batch_rows(112)[-1] == 112
    assert prompt_token_columns(2048) == (0, 64, 128, 256, 512, 1024, 2048, 4096)
    config = EngineConfig(max_concurrency=3, page_size=16, num_pages=16, prefill_chunk=64,
                          max_num_batched_tokens=131, max_model_len=measurement_model_len(64, decode_context=64))
    loaded = load_checkpoint_model(stories260k, config)
    runner = ModelRunner(loaded.model, loaded.model_config, config, "cpu", torch.float32, seed=0)
    shapes = []
    launch = runner.launch
    monkeypatch.setattr(runner, "launch", lambda plan: (shapes.append(
        tuple((row.num_computed_tokens, row.num_new_tokens, row.samples) for row in plan.rows)), launch(plan))[1])
    costs = measure_step_costs(runner, "cpu", decode_context=64, repeats=2, warm_ups=1)
    assert (costs.device, costs.decode_context) == ("cpu", 64)
    assert costs.decode_batches == (1, 3) and costs.prompt_tokens == (0, 64, 128)
    assert all(ms > 0 for row in costs.milliseconds for ms in row)
    # the decodes alone again at the longest context seated (two chunks): what longer contexts add
    assert costs.long_context == 128 and len(costs.long_decode_ms) == 2 and min(costs.long_decode_ms) > 0
    assert shapes[0] == ((127, 1, True),) * 3                            # every slot seated once
    grid = [shape for shape in shapes[1:] if shape[0][0] == 63]         # 2 repeats after 1 warm-up a cell
    longer = [shape for shape in shapes[1:] if shape[0][0] == 127]
    assert len(grid) >= 6 * 3 and len(longer) >= 2 * 3 and len(grid) + len(longer) == len(shapes) - 1
    # the largest batch's prompt columns: 2 decodes (a prompt needs a slot of its own) and the prompt after them
    assert grid[6 * 3 - 1] == ((63, 1, True), (63, 1, True), (0, 128, False))
    assert grid[0] == ((63, 1, True),) and longer[:3] == [((127, 1, True),)] * 3
    assert longer[3:6] == [((127, 1, True),) * 3] * 3
    assert all(state is None for state in runner.slots.requests)


def test_a_cell_dearer_than_more_work_is_timed_again_and_keeps_its_lowest_time():
    """A host stall can hold a cell's median (an H200 export timed 1 decode + 512 prompt tokens at 287 ms
    and + 2,048 at 74 ms). Noise only adds time, so a cell above a cell of more work (its row's next
    column, its column's next row) is timed again, at most twice, and keeps the lowest time."""
    from flare.engine.step_cost import retime_outliers

    grid = [[5.0, 14.0, 287.0, 74.0],
            [6.0, 15.0, 35.0, 76.0],
            [9.0, 18.0, 36.0, 78.0]]
    again = {(0, 2): [30.0], (1, 0): []}
    asked = []

    def time_cell(row, column):
        asked.append((row, column))
        return again[(row, column)].pop(0) if again.get((row, column)) else 40.0

    assert retime_outliers(grid, time_cell) == [(0, 2)]
    assert grid[0] == [5.0, 14.0, 30.0, 74.0] and asked == [(0, 2)]
    chain = [[90.0, 80.0, 10.0]]                          # the dearer neighbour is settled first
    assert retime_outliers(chain, lambda row, column: 8.0) == [(0, 1), (0, 0)]
    assert chain == [[8.0, 8.0, 10.0]]
    stuck = [[50.0, 10.0], [60.0, 70.0]]                 # still dear when timed again: twice, then kept
    assert retime_outliers(stuck, lambda row, column: 45.0) == [(0, 0), (0, 0)]
    assert stuck[0][0] == 45.0
