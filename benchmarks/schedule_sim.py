#!/usr/bin/env python
"""The served schedule on a virtual clock: the real EngineCore and scheduler, priced by measured steps.

A step-cost table (`ignition export` measures one on a GPU and records it as `Plan.step_costs`; the
JSON `serve_gpu_run.sh` writes as step_costs.json) gives the time of a step from its decoding requests
and its prompt tokens. Here the real engine core plans every step of a serve_bench-like load (closed
loop: `concurrency` requests at once, the next one arriving as one finishes; IN tokens in, OUT out,
no end of sequence), a runner that computes nothing answers it, and a virtual clock advances by the
table's price of each step. What comes out is what the scheduler's choices cost on that device: time to
first token, time per output token and output tokens per second per concurrency and policy, in
seconds and without a GPU.

It is an estimate, as good as the table: the host's own time outside the table (HTTP, detokenization)
is not in it, and the price of a step is interpolated from the grid (flare.engine.step_cost). Compare
policies and bounds with it; measure the winner on the device.

Policies: `balanced` (the default, with the table's cadence bound), `throughput`, `no-costs` (balanced
without a table: one prefill chunk beside decodes), `floor256` (balanced as it was until the bound's
floor changed: never fewer than 256 prompt tokens beside decodes, the choice behind the H200 run of
2026-12-02 at 13b93ce), and `bound:MS` (balanced with --scheduler-max-step-ms MS).

    python benchmarks/schedule_sim.py COSTS.json --concurrency 1,16,64,256 --policies balanced,floor256 \
        --output schedule_sim.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from dataclasses import dataclass, field, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from flare.engine.config import EngineConfig, step_token_budget  # noqa: E402
from flare.engine.core import EngineCore  # noqa: E402
from flare.engine.policy import SchedulerPolicy  # noqa: E402
from flare.engine.request import EngineRequest  # noqa: E402
from flare.engine.sampling_params import SamplingParams  # noqa: E402
from flare.engine.step import DoneStep, StepPlan, StepResult  # noqa: E402
from flare.engine.step_cost import StepCosts, step_costs_from_json  # noqa: E402

TOKEN = 5            # what the runner answers; no end-of-sequence id is set, so requests run to OUT


class VirtualClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


@dataclass
class Timeline:
    """When each request arrived and when each of its tokens came out (seconds on the virtual clock)."""

    arrived: dict[str, float] = field(default_factory=dict)
    tokens: dict[str, list[float]] = field(default_factory=dict)


class PricedRunner:
    """The step contract without a model: every sampling row answers TOKEN when its step ends, and the
    clock advances by the table's price of the step (its one-token rows counted as decodes)."""

    vocab_size = 128_256

    def __init__(self, costs: StepCosts, clock: VirtualClock, timeline: Timeline) -> None:
        self.costs, self.clock, self.timeline = costs, clock, timeline
        self.num_steps = 0

    def samples_ahead(self, params) -> bool:
        return True

    def reset(self) -> None:
        pass

    def launch(self, plan: StepPlan) -> DoneStep:
        decoding = [row for row in plan.rows if row.num_new_tokens == 1]
        prompt = sum(row.num_new_tokens for row in plan.rows if row.num_new_tokens > 1)
        context = sum(row.num_computed_tokens + 1 for row in decoding) / len(decoding) if decoding else 0.0
        self.clock.now += self.costs.step_ms(len(decoding), prompt, context) / 1000.0
        self.num_steps += 1
        for row in plan.rows:
            if row.samples:
                self.timeline.tokens.setdefault(row.request_id, []).append(self.clock.now)
        return DoneStep(StepResult(tuple((TOKEN,) if row.samples else () for row in plan.rows)))


class Floor256Policy(SchedulerPolicy):
    """balanced as at 13b93ce: the table's count beside decodes, never below min(chunk, 256)."""

    def prefill_cap(self, step_budget: int, prefill_chunk: int, num_decoding: int, mean_context: float = 0.0) -> int:
        if self.name == "throughput" or num_decoding == 0:
            return step_budget
        fits = self.step_costs.prompt_tokens_within(num_decoding, self.max_step_ms, mean_context)
        return min(step_budget, max(fits, min(prefill_chunk, 256)))


def policy_for(name: str, costs: StepCosts, prepared: int) -> SchedulerPolicy:
    if name == "balanced":
        return SchedulerPolicy().with_step_costs(costs, prepared)
    if name == "throughput":
        return SchedulerPolicy(name="throughput")
    if name == "no-costs":
        return SchedulerPolicy()
    if name == "floor256":
        chosen = SchedulerPolicy().with_step_costs(costs, prepared)
        return Floor256Policy(**{f: getattr(chosen, f) for f in chosen.__dataclass_fields__})
    if name.startswith("bound:"):
        return SchedulerPolicy().with_step_costs(costs, prepared, max_step_ms=float(name.split(":", 1)[1]))
    raise SystemExit(f"unknown policy {name!r}: balanced, throughput, no-costs, floor256 or bound:MS")


@dataclass(frozen=True)
class Load:
    concurrency: int
    requests: int
    input_len: int
    output_len: int


def simulate(costs: StepCosts, policy: SchedulerPolicy, load: Load, args) -> dict:
    """One closed-loop level: its timeline through the real core, summarised."""
    config = EngineConfig(max_concurrency=load.concurrency, page_size=args.page_size, num_pages=args.num_pages,
                          prefill_chunk=args.prefill_chunk, max_model_len=args.max_model_len,
                          max_num_batched_tokens=step_token_budget(args.prefill_chunk, load.concurrency),
                          scheduler_policy=policy)
    clock, timeline = VirtualClock(), Timeline()
    runner = PricedRunner(costs, clock, timeline)
    core = EngineCore(config, runner)
    core.scheduler.clock = clock
    started = 0

    def arrive() -> None:
        nonlocal started
        request_id = f"r{started}"
        prompt = tuple((started * 7919 + 13 * i) % 50_000 + 10 for i in range(load.input_len))
        core.add_request(EngineRequest(request_id, prompt, SamplingParams(max_tokens=load.output_len)))
        timeline.arrived[request_id] = clock.now
        started += 1

    for _ in range(min(load.concurrency, load.requests)):
        arrive()
    while core.has_unfinished():
        for output in core.step():
            if output.finish_reason is not None and started < load.requests:
                arrive()
    return summary(timeline, load, clock.now, runner.num_steps)


def summary(timeline: Timeline, load: Load, duration: float, steps: int) -> dict:
    ttft = [times[0] - timeline.arrived[r] for r, times in timeline.tokens.items()]
    tpot = [(times[-1] - times[0]) / (len(times) - 1) for times in timeline.tokens.values() if len(times) > 1]
    itl = [b - a for times in timeline.tokens.values() for a, b in zip(times, times[1:])]
    tokens = sum(len(times) for times in timeline.tokens.values())
    return {"concurrency": load.concurrency, "requests": load.requests, "steps": steps,
            "duration_s": duration, "output_tokens_per_s": tokens / duration,
            "ttft_ms": percentiles(ttft), "tpot_ms": percentiles(tpot), "itl_ms": percentiles(itl)}


def percentiles(seconds: list[float]) -> dict:
    ms = sorted(s * 1000.0 for s in seconds)
    if not ms:
        return {"mean": 0.0, "p50": 0.0, "p99": 0.0}
    return {"mean": statistics.fmean(ms), "p50": ms[len(ms) // 2], "p99": ms[min(len(ms) - 1, int(0.99 * len(ms)))]}


def load_costs(path: str) -> StepCosts:
    return step_costs_from_json(Path(path).read_text())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("costs", help="a step-cost table as JSON (serve_gpu_run.sh's step_costs.json)")
    parser.add_argument("--concurrency", default="1,16,64,256")
    parser.add_argument("--requests-per-concurrency", type=int, default=4, help="requests = N x concurrency (at least 8)")
    parser.add_argument("--input-len", type=int, default=1000)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--policies", default="balanced,throughput")
    parser.add_argument("--prepared-concurrency", type=int, default=256, help="the package's; sets the default bound")
    parser.add_argument("--prefill-chunk", type=int, default=2048)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--num-pages", type=int, default=62_225, help="the KV pool (the H200 llama-8b run: 62,225)")
    parser.add_argument("--max-model-len", type=int, default=131_072)
    parser.add_argument("--output", help="write the JSON here")
    args = parser.parse_args(argv)
    costs = load_costs(args.costs)
    rows = []
    print(f"step costs of {costs.device}; {args.input_len} in / {args.output_len} out, closed loop")
    print(f"{'policy':>12} {'conc':>5} {'steps':>6} {'tok/s':>8} {'TTFT p50':>9} {'TTFT p99':>9} "
          f"{'TPOT p50':>9} {'ITL p50':>8} {'ITL p99':>8}")
    for name in args.policies.split(","):
        policy = policy_for(name, costs, args.prepared_concurrency)
        for concurrency in (int(c) for c in args.concurrency.split(",")):
            load = Load(concurrency, max(8, args.requests_per_concurrency * concurrency), args.input_len,
                        args.output_len)
            row = dict(simulate(costs, policy, load, args), policy=name, max_step_ms=policy.max_step_ms)
            rows.append(row)
            print(f"{name:>12} {concurrency:>5} {row['steps']:>6} {row['output_tokens_per_s']:>8,.0f} "
                  f"{row['ttft_ms']['p50']:>9.1f} {row['ttft_ms']['p99']:>9.1f} {row['tpot_ms']['p50']:>9.2f} "
                  f"{row['itl_ms']['p50']:>8.2f} {row['itl_ms']['p99']:>8.2f}")
    if args.output:
        Path(args.output).write_text(json.dumps({"benchmark": "schedule_sim", "costs": args.costs,
                                                 "device": costs.device, "input_len": args.input_len,
                                                 "output_len": args.output_len, "levels": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
