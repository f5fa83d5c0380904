#!/usr/bin/env python
"""The host side of an engine step, without a model: scheduling and the runner's input preparation.

An EngineCore over the real ModelRunner whose model and sampler are stand-ins that return zeros at once
(on a GPU both are device work), so what is timed is the Python and torch work around them:
`Scheduler.schedule()`, the runner's step (inputs into tensors, page tables, the static decode buffers,
ids back to the host) and the core's update. B requests of C prompt tokens are prefilled (untimed), then
every timed step decodes one token for each, greedy. Times are the thread's CPU time
(`time.thread_time`), so other work sharing the machine's cores does not count; the wall time of the
whole step is in the JSON. Runner modes: `graphs` (the static-buffer decode path that CUDA graphs
replay; on a CPU it runs the stand-in eagerly on those buffers) and `flat` (the flattened path that
prompt-carrying steps take).

    python benchmarks/step_host.py --batches 1,16,64,256 --contexts 1000,4000 --output step_host.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

VOCAB = 64
PAGE_SIZE = 16


class StandInModel:
    """Returns zeros of the right shapes at once: hidden [T, 4], logits [N, VOCAB]."""

    def __call__(self, input_ids, positions, kv_caches, meta):
        import torch

        return torch.zeros(input_ids.shape[0], 4, device=input_ids.device)

    def compute_logits(self, hidden):
        import torch

        return torch.zeros(hidden.shape[0], VOCAB, device=hidden.device)

    def modules(self):
        return iter(())


def model_config():
    return SimpleNamespace(vocab_size=VOCAB, num_key_value_heads=1, head_dim=1, num_hidden_layers=1,
                           kv_cache_dtype="auto")


def decode_budget(batch: int, context: int, steps: int) -> int:
    """Tokens each request may decode: the timed steps, plus one per step while later requests prefill."""
    return steps + batch * context // 2048 + batch + 8


def build_core(batch: int, context: int, steps: int, mode: str):
    from flare.engine.config import EngineConfig
    from flare.engine.core import EngineCore
    from flare.engine.runner import ModelRunner

    max_model_len = context + decode_budget(batch, context, steps) + 16
    pages_per_request = -(-max_model_len // PAGE_SIZE)
    config = EngineConfig(max_concurrency=batch, page_size=PAGE_SIZE, num_pages=batch * pages_per_request,
                          prefill_chunk=2048, max_num_batched_tokens=2048 + batch, max_model_len=max_model_len,
                          enable_prefix_caching=False)
    runner = ModelRunner(StandInModel(), model_config(), config, "cpu", seed=0, graphs=mode == "graphs",
                         capture=False)
    runner.sampler.sample = stand_in_sample
    return EngineCore(config, runner, eos_token_ids=())


def stand_in_sample(logits, slots, positions, allowed_bitmask=None):
    """Token 0 for every row at once. On a GPU sampling is device work (inside the decode graph, or
    kernels queued behind the forward); on a CPU its torch reference would be timed as host work."""
    import torch

    return torch.zeros(logits.shape[0], dtype=torch.int64, device=logits.device)


class PhaseTimer:
    """Wraps an object's method so each call's CPU time is recorded."""

    def __init__(self, owner, name: str) -> None:
        self.samples: list[float] = []
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            started = time.thread_time()
            try:
                return original(*args, **kwargs)
            finally:
                self.samples.append(time.thread_time() - started)

        setattr(owner, name, timed)


def run_case(batch: int, context: int, mode: str, warmup: int, steps: int) -> dict:
    import torch

    from flare.engine.request import EngineRequest
    from flare.engine.sampling_params import SamplingParams

    core = build_core(batch, context, warmup + steps, mode)
    generator = torch.Generator().manual_seed(batch * 7919 + context)
    params = SamplingParams(temperature=0, max_tokens=decode_budget(batch, context, warmup + steps), ignore_eos=True)
    for i in range(batch):
        prompt = torch.randint(1, VOCAB, (context,), generator=generator).tolist()
        core.add_request(EngineRequest(f"r{i}", tuple(prompt), params))
    while any(r.num_output_tokens == 0 for r in core.requests.values()):
        core.step()                                         # prefill, untimed
    schedule = PhaseTimer(core.scheduler, "schedule")
    runner_phases = [PhaseTimer(core.runner, name) for name in ("launch", "execute") if hasattr(core.runner, name)]
    step_times, wall_times = [], []
    for i in range(warmup + steps):
        started, wall_started = time.thread_time(), time.perf_counter()
        core.step()
        step_times.append(time.thread_time() - started)
        wall_times.append(time.perf_counter() - wall_started)
        if core.stats().num_running != batch:
            raise RuntimeError(f"B{batch} C{context}: only {core.stats().num_running} requests decode")
    count = warmup + steps
    runner_samples = [sum(t.samples[i] for t in runner_phases if len(t.samples) == count) for i in range(count)]

    def median_ms(samples):
        return statistics.median(samples[warmup:]) * 1000

    step_ms, schedule_ms, runner_ms = median_ms(step_times), median_ms(schedule.samples), median_ms(runner_samples)
    return {"batch": batch, "context": context, "mode": mode, "step_ms": step_ms, "schedule_ms": schedule_ms,
            "runner_ms": runner_ms, "rest_ms": step_ms - schedule_ms - runner_ms,
            "wall_step_ms": median_ms(wall_times), "step_ms_samples": [t * 1000 for t in step_times[warmup:]]}


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).resolve().parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,16,64,256")
    parser.add_argument("--contexts", default="1000,4000")
    parser.add_argument("--modes", default="graphs,flat")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)

    import torch

    from flare.bench import device_identity

    torch.set_num_threads(1)
    result = {"benchmark": "engine step host time", "command": " ".join(sys.argv), "commit": commit(),
              "device": device_identity(), "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "warmup": args.warmup, "steps": args.steps, "cases": []}
    print("CPU ms per step (median):")
    print(f"{'mode':<7}{'B':>5}{'C':>6}{'step':>10}{'schedule':>10}{'runner':>10}{'rest':>8}")
    for mode in args.modes.split(","):
        for context in (int(c) for c in args.contexts.split(",")):
            for batch in (int(b) for b in args.batches.split(",")):
                case = run_case(batch, context, mode, args.warmup, args.steps)
                result["cases"].append(case)
                print(f"{mode:<7}{batch:>5}{context:>6}{case['step_ms']:>10.3f}{case['schedule_ms']:>10.3f}"
                      f"{case['runner_ms']:>10.3f}{case['rest_ms']:>8.3f}", flush=True)
                if args.output:
                    args.output.parent.mkdir(parents=True, exist_ok=True)
                    args.output.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
