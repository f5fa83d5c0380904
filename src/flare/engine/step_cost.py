"""What one engine step costs: measured at export on the device, read by the `balanced` policy.

A step carries the decoding requests' next tokens and, beside them, some prompt tokens. Its time grows
with both, and every decoding request waits that long for its next token. `measure_step_costs` times
steps through the runner, as serving runs them (decode-only steps replay their captured graphs, steps
with prompt work run the compiled model), on a grid of decode batch sizes × prompt-token counts, and
`StepCosts` answers the policy's question from that grid: how many prompt tokens fit beside this many
decodes within a bound (`flare.engine.policy`). The package's plan records the grid
(`flare.package.manifest.StepCostTable`); a package exported without a GPU has none.

What the measurement fixes, and so approximates: every decoding request at `decode_context` tokens of
context, and the prompt tokens as one request's chunk from position 0 (a long chunk's attention costs a
little more than several shorter ones', so the estimate errs long). A step with prompt work has at most
`max_concurrency - 1` decoding requests (the prompt's request holds a slot too), so that is how many
the largest batch's prompt columns are measured with. Times are wall-clock from launch to the ids on the
host: what the next token of a decoding request waits.

Between grid points times are interpolated linearly, with one exception: any prompt work below the first
measured prompt column costs what that column did, since a step with prompt work pays a fixed price
that decode-only steps do not (it runs the model outside the decode graphs: on an H200, a llama-8b step
with 64 prompt tokens took ~40 ms where the decodes alone took 5-18 ms). A batch beyond the grid takes
its nearest row, and prompt tokens are never estimated beyond the last measured column. Each row is
made non-decreasing in prompt tokens (a running maximum) so that timing noise cannot make more work
look cheaper; and a cell measured dearer than a cell of more work is timed again first (`retime_outliers`),
since noise only adds time.
"""

from __future__ import annotations

import bisect
import math
import statistics
import time
from dataclasses import dataclass

DECODE_CONTEXT = 1024        # the context of each decoding request in the measured steps
SMALLEST_PROMPT_COLUMN = 64


@dataclass(frozen=True)
class StepCosts:
    """milliseconds[i][j]: one step with decode_batches[i] decoding requests and prompt_tokens[j] prompt
    tokens beside them, on `device`."""

    device: str
    decode_context: int
    decode_batches: tuple[int, ...]           # rising, from 1
    prompt_tokens: tuple[int, ...]            # rising, from 0
    milliseconds: tuple[tuple[float, ...], ...]
    long_context: int = 0                     # 0: decodes timed at decode_context only
    long_decode_ms: tuple[float, ...] = ()    # decode_batches[i] decodes alone, each at long_context tokens

    def __post_init__(self) -> None:
        self._check_grid()
        if self.long_context or self.long_decode_ms:
            if self.long_context <= self.decode_context or len(self.long_decode_ms) != len(self.decode_batches):
                raise ValueError(f"step costs: long_context {self.long_context} must exceed decode_context "
                                 f"{self.decode_context}, with one long_decode_ms per decode batch")
            if not all(math.isfinite(ms) and ms > 0 for ms in self.long_decode_ms):
                raise ValueError("step costs: every long_decode_ms must be a finite, positive number")

    def _check_grid(self) -> None:
        batches, tokens = self.decode_batches, self.prompt_tokens
        if not batches or batches[0] < 1 or list(batches) != sorted(set(batches)):
            raise ValueError(f"step costs: decode_batches {list(batches)} must be distinct, rising and from 1")
        if not tokens or tokens[0] != 0 or list(tokens) != sorted(set(tokens)):
            raise ValueError(f"step costs: prompt_tokens {list(tokens)} must be distinct, rising and from 0")
        if len(self.milliseconds) != len(batches) or any(len(row) != len(tokens) for row in self.milliseconds):
            raise ValueError(f"step costs: milliseconds must be {len(batches)} rows of {len(tokens)} times")
        if not all(math.isfinite(ms) and ms > 0 for row in self.milliseconds for ms in row):
            raise ValueError("step costs: every time must be a finite, positive number of milliseconds")

    def step_ms(self, num_decodes: int, num_prompt_tokens: int, mean_context: float = 0.0) -> float:
        """The estimated time of a step with these decodes (at `mean_context` tokens of context on average;
        0: the measured decode_context) and prompt tokens."""
        row = self._row(num_decodes)
        tokens = self.prompt_tokens
        extra = self.context_ms(num_decodes, mean_context)
        if num_prompt_tokens <= 0 or len(tokens) == 1:     # decodes alone, or prompt work not measured
            return row[0] + extra
        j = max(1, min(bisect.bisect_right(tokens, num_prompt_tokens) - 1, len(tokens) - 2))
        if j + 1 >= len(tokens) or num_prompt_tokens <= tokens[j]:
            return row[j] + extra                   # at or below the first prompt column: its price
        share = min(1.0, (num_prompt_tokens - tokens[j]) / (tokens[j + 1] - tokens[j]))
        return row[j] + share * (row[j + 1] - row[j]) + extra

    def context_ms(self, num_decodes: int, mean_context: float) -> float:
        """What `num_decodes` decoding requests at `mean_context` tokens of context on average add to a step
        over the same requests at decode_context: linear in the context through the decode step measured
        at decode_context and at long_context (their attention reads every token of it; an H200 at 256
        requests of 1,000-2,000 tokens ran ~4 ms a step above a table timed at 1,024). Nothing at or below
        decode_context, or without a long measurement."""
        if not self.long_context or mean_context <= self.decode_context:
            return 0.0
        longer = _interpolated(self.decode_batches, self.long_decode_ms, num_decodes)
        decodes = _interpolated(self.decode_batches, [row[0] for row in self.milliseconds], num_decodes)
        per_token = max(0.0, longer - decodes) / (self.long_context - self.decode_context)
        return per_token * (mean_context - self.decode_context)

    def prompt_tokens_within(self, num_decodes: int, bound_ms: float, mean_context: float = 0.0) -> int:
        """The most prompt tokens a step with `num_decodes` decoding requests (at `mean_context` tokens of
        context on average) may carry and still take no longer than `bound_ms`: 0 when no measured step
        with prompt work fits (prompt work costs at least the first prompt column's time), at most the
        last measured column."""
        row, tokens = self._row(num_decodes), self.prompt_tokens
        bound_ms -= self.context_ms(num_decodes, mean_context)
        within = bisect.bisect_right(row, bound_ms)           # rows are non-decreasing
        if within <= 1:
            return 0
        if within == len(row):
            return tokens[-1]
        j = within - 1                              # row[j] <= bound < row[j + 1], j >= 1
        share = (bound_ms - row[j]) / (row[j + 1] - row[j])
        return int(tokens[j] + share * (tokens[j + 1] - tokens[j]))

    def _row(self, num_decodes: int) -> list[float]:
        """The times at each prompt column for `num_decodes`, interpolated between measured batches."""
        columns = zip(*self.milliseconds)
        return _running_max([_interpolated(self.decode_batches, column, num_decodes) for column in columns])


def _interpolated(batches: tuple[int, ...], values, num_decodes: int) -> float:
    """values[i] belongs to batches[i]: linear between measured batches, the nearest beyond them."""
    i = bisect.bisect_right(batches, num_decodes) - 1
    if i < 0:
        return values[0]
    if i >= len(batches) - 1:
        return values[-1]
    share = (num_decodes - batches[i]) / (batches[i + 1] - batches[i])
    return values[i] + share * (values[i + 1] - values[i])


def step_costs_from_json(text: str) -> StepCosts:
    """A step-cost table from the JSON of a plan's record (`serve_gpu_run.sh`'s step_costs.json)."""
    import json

    data = json.loads(text)
    return StepCosts(data["device"], data["decode_context"], tuple(data["decode_batches"]),
                     tuple(data["prompt_tokens"]), tuple(tuple(row) for row in data["milliseconds"]),
                     data.get("long_context", 0), tuple(data.get("long_decode_ms", ())))


def _running_max(values) -> list[float]:
    out, top = [], -math.inf
    for value in values:
        top = max(top, value)
        out.append(top)
    return out


# ---- measuring -------------------------------------------------------------------------------------------

def decode_batch_rows(max_concurrency: int) -> tuple[int, ...]:
    """The decode batch sizes measured: 1, 4, 16, 64, ... below the concurrency, and the concurrency."""
    rows, batch = [], 1
    while batch < max_concurrency:
        rows.append(batch)
        batch *= 4
    return (*rows, max_concurrency)


def prompt_token_columns(prefill_chunk: int) -> tuple[int, ...]:
    """The prompt-token counts measured: 0, 64, 128, ... doubling below two prefill chunks, and two chunks
    (the most prompt work a step's token budget holds, `flare.engine.config.step_token_budget`)."""
    columns, tokens = [0], SMALLEST_PROMPT_COLUMN
    while tokens < 2 * prefill_chunk:
        columns.append(tokens)
        tokens *= 2
    return (*columns, 2 * prefill_chunk)


def measure_step_costs(runner, device_name: str, *, decode_context: int = DECODE_CONTEXT,
                       repeats: int = 5, warm_ups: int = 2) -> StepCosts:
    """Time steps of `runner` (a `flare.engine.runner.ModelRunner`) on the grid of `decode_batch_rows` ×
    `prompt_token_columns` for its config, and each batch's decodes alone at the longest context the
    measurement seats (two prefill chunks: `long_decode_ms`); the median of `repeats` after `warm_ups`. Its
    slots are freed before and after. The runner's config must hold `measurement_model_len` tokens per
    request."""
    config = runner.config
    batches = decode_batch_rows(config.max_concurrency)
    tokens = prompt_token_columns(config.prefill_chunk)
    long_context = max(decode_context, tokens[-1])          # what every slot holds: decodes there too
    runner.reset()
    _seat_every_slot(runner, long_context)

    def timed_grid(context: int, prompts: tuple[int, ...]) -> tuple[tuple[float, ...], ...]:
        """Steps of batches x prompts at `context`, outliers timed again (`retime_outliers`), in ms."""
        def time_cell(row: int, column: int, warm: int = 0) -> float:
            return _median_ms(runner, _step(config, batches[row], prompts[column], context), repeats, warm)

        grid = [[time_cell(row, column, warm_ups) for column in range(len(prompts))] for row in range(len(batches))]
        retime_outliers(grid, time_cell)
        return tuple(tuple(round(ms, 3) for ms in row) for row in grid)

    try:
        milliseconds = timed_grid(decode_context, tokens)
        longer = timed_grid(long_context, (0,)) if long_context > decode_context else ()
    finally:
        runner.reset()
    return StepCosts(device_name, decode_context, batches, tokens, milliseconds,
                     long_context if longer else 0, tuple(row[0] for row in longer))


OUTLIER_RATIO = 1.2          # a cell this much dearer than a cell of more work is timed again
RETIMES = 2


def retime_outliers(grid: list[list[float]], time_cell) -> list[tuple[int, int]]:
    """Time again (`time_cell(row, column)`), up to RETIMES times, each cell of `grid` dearer than
    OUTLIER_RATIO x a cell with more work (the next prompt column of its row, the next batch row of its
    column), keeping the lowest time; the cells timed again, in order. A step does not cost more than one
    doing more, so such a cell caught noise: a host stall held the median of its repeats (an H200 export
    once timed 1 decode beside 512 prompt tokens at 287 ms and beside 2,048 at 74 ms). Cells go from the
    most work back, so that the cells a cell is held against are settled first."""
    retimed = []
    for row in reversed(range(len(grid))):
        for column in reversed(range(len(grid[row]))):
            for _ in range(RETIMES):
                if not _dearer_than_more_work(grid, row, column):
                    break
                retimed.append((row, column))
                grid[row][column] = min(grid[row][column], time_cell(row, column))
    return retimed


def _dearer_than_more_work(grid: list[list[float]], row: int, column: int) -> bool:
    more_work = [grid[row][column + 1]] if column + 1 < len(grid[row]) else []
    if row + 1 < len(grid):
        more_work.append(grid[row + 1][column])
    return bool(more_work) and grid[row][column] > OUTLIER_RATIO * min(more_work)


def measurement_model_len(prefill_chunk: int, decode_context: int = DECODE_CONTEXT) -> int:
    """The context a runner needs for `measure_step_costs`."""
    return max(decode_context, 2 * prefill_chunk) + 1


def _seat_every_slot(runner, length: int) -> None:
    """Seat a request of `length` random-sampling prompt ids in every slot, its page table covering them
    (pages reused cyclically: the measured steps read and write garbage K/V, which costs the same)."""
    import random

    from flare.engine.sampling_params import SamplingParams
    from flare.engine.step import NewRequest, ScheduledRow, StepPlan

    config = runner.config
    ids = random.Random(0)
    prompt = tuple(ids.randrange(3, max(4, runner.vocab_size)) for _ in range(length))
    params = SamplingParams(temperature=1.0, top_p=0.9, ignore_eos=True)
    pages = tuple(page % config.num_pages for page in range(-(-length // config.page_size)))
    new = tuple(NewRequest(f"flare-step-cost-{slot}", slot, prompt, (), params)
                for slot in range(config.max_concurrency))
    rows = tuple(ScheduledRow(request.request_id, request.slot, length - 1, 1, pages, True) for request in new)
    runner.launch(StepPlan(rows, new)).result()


def _step(config, batch: int, prompt_tokens: int, decode_context: int):
    """The plan of one measured step: `batch` decoding slots first, then one slot's prompt chunk."""
    from flare.engine.step import ScheduledRow, StepPlan

    decoders = min(batch, config.max_concurrency - 1) if prompt_tokens else batch
    rows = [ScheduledRow(f"flare-step-cost-{slot}", slot, decode_context - 1, 1, (), True)
            for slot in range(decoders)]
    if prompt_tokens:
        slot = config.max_concurrency - 1
        rows.append(ScheduledRow(f"flare-step-cost-{slot}", slot, 0, prompt_tokens, (), False))
    return StepPlan(tuple(rows))


def _median_ms(runner, plan, repeats: int, warm_ups: int) -> float:
    for _ in range(warm_ups):
        runner.launch(plan).result()
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        runner.launch(plan).result()
        samples.append((time.perf_counter() - started) * 1000.0)
    return statistics.median(samples)
