#!/usr/bin/env python
"""The engine's real decode step: EngineCore.step() (scheduler, runner, graph or eager forward, sampler,
state update) on a benchmark architecture with random weights, timed per step on the host clock.

For each batch B and context C: B requests of C random prompt tokens are prefilled through the engine,
then every step decodes one token for each (greedy). Reported per case, median over the timed steps:
  step_ms     wall time of one EngineCore.step() (it returns with a step's ids on the host: the real TPOT;
              one step ahead, it launches step N+1 and then reads step N's ids)
  launch_ms   of that, inside ModelRunner.launch (the host's part of the step)
  gpu_ms      CUDA-event time of the captured graph alone (graph modes), replayed back to back
  host_ms     step_ms - gpu_ms: time the GPU waits for Python each step
`--one-step-ahead off` runs one step at a time (nothing overlaps), for comparison; `--sampling top-p`
samples at temperature 0.6, top-p 0.9 (seeded per request) instead of greedily.

Modes: eager (no graphs, no compile), graphs (captured decode, eager layers), compiled (layers
compiled with torch.compile, then captured). One mode per process keeps a failure contained.

    python benchmarks/decode_engine.py llama-8b --mode compiled --batches 1,8,32,64 --contexts 512 \
        --output out.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from shapes import SHAPES, randomize_  # noqa: E402

TINY = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=64, intermediate_size=128,
            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=512,
            max_position_embeddings=4096, rms_norm_eps=1e-5, tie_word_embeddings=False, bos_token_id=1,
            eos_token_id=2, torch_dtype="float32")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shape", choices=[*sorted(SHAPES), "tiny"])
    parser.add_argument("--mode", choices=["eager", "graphs", "compiled"], default="compiled")
    parser.add_argument("--batches", default="1,8,32,64")
    parser.add_argument("--contexts", default="512")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--max-model-len", type=int, default=8192,
                        help="the engine's max_model_len (sets the split-K count of decode attention in graphs)")
    parser.add_argument("--one-step-ahead", choices=["on", "off"], default="on")
    parser.add_argument("--sampling", choices=["greedy", "top-p"], default="greedy")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)

    import torch

    from flare.bench import device_identity
    from flare.engine.config import EngineConfig
    from flare.engine.factory import attention_backend
    from flare.models import ModelConfig, build_model

    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.contexts.split(",")]
    on_cuda = torch.cuda.is_available()
    device = "cuda" if on_cuda else "cpu"
    dtype = torch.bfloat16 if on_cuda else torch.float32
    cfg = ModelConfig.from_hf_config(TINY if args.shape == "tiny" else SHAPES[args.shape])
    page_size = 16
    longest = max(contexts) + decode_budget(max(batches), max(contexts), args.warmup, args.steps)
    max_model_len = max(args.max_model_len, longest)
    pages_per_request = -(-longest // page_size)
    config = EngineConfig(max_concurrency=max(batches), page_size=page_size,
                          num_pages=max(max(batches) * pages_per_request, -(-max_model_len // page_size)),
                          prefill_chunk=2048,
                          max_num_batched_tokens=max(2048, max(batches)), max_model_len=max_model_len,
                          enable_prefix_caching=False, one_step_ahead=args.one_step_ahead == "on")

    started = time.perf_counter()
    model = build_model(cfg, dtype, device, attention_backend(device))
    randomize_(model)
    timings = {"build_model_s": time.perf_counter() - started}
    started = time.perf_counter()
    if args.mode == "compiled":
        from flare.engine.compile import compile_model

        compile_model(model)
    from flare.engine.runner import ModelRunner

    graphs = args.mode != "eager"
    runner = ModelRunner(model, cfg, config, device, dtype, seed=0, graphs=graphs, capture=on_cuda and graphs)
    timings["compile_and_capture_s"] = time.perf_counter() - started   # compile is lazy: first capture pays it

    result = {"benchmark": "engine decode step", "shape": args.shape, "mode": args.mode,
              "one_step_ahead": args.one_step_ahead, "sampling": args.sampling,
              "max_model_len": max_model_len, "command": " ".join(sys.argv),
              "device": device_identity(), "dtype": str(dtype), "page_size": page_size,
              "warmup": args.warmup, "steps": args.steps, "startup": timings, "cases": [],
              "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())}
    print(f"{args.shape} {args.mode}: model {timings['build_model_s']:.1f} s, compile+capture "
          f"{timings['compile_and_capture_s']:.1f} s", flush=True)
    for context in contexts:
        for batch in batches:
            case = run_case(runner, config, cfg.vocab_size, batch, context, args.warmup, args.steps, args.sampling)
            result["cases"].append(case)
            print(f"B{batch:<3} C{context:<5} step {case['step_ms']:.3f} ms  launch {case['launch_ms']:.3f}  "
                  f"gpu {case['gpu_ms'] if case['gpu_ms'] is None else round(case['gpu_ms'], 3)}  "
                  f"host {case['host_ms'] if case['host_ms'] is None else round(case['host_ms'], 3)}  "
                  f"{case['tokens_per_s']:.0f} tok/s", flush=True)
            if args.output:
                args.output.parent.mkdir(parents=True, exist_ok=True)
                args.output.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def decode_budget(batch: int, context: int, warmup: int, steps: int) -> int:
    """Tokens each request may decode: the timed steps, plus those it decodes while later requests
    still prefill (at most one per prefill step)."""
    return warmup + steps + batch * context // 1024 + batch + 8


def run_case(runner, config, vocab_size: int, batch: int, context: int, warmup: int, steps: int,
             sampling: str = "greedy") -> dict:
    import torch

    from flare.engine.core import EngineCore
    from flare.engine.request import EngineRequest
    from flare.engine.sampling_params import SamplingParams

    core = EngineCore(config, runner, eos_token_ids=())
    generator = torch.Generator().manual_seed(batch * 100003 + context)
    budget = decode_budget(batch, context, warmup, steps)
    params = SamplingParams(temperature=0, max_tokens=budget, ignore_eos=True)
    if sampling == "top-p":
        params = SamplingParams(temperature=0.6, top_p=0.9, seed=0, max_tokens=budget, ignore_eos=True)
    for i in range(batch):
        prompt = torch.randint(3, vocab_size, (context,), generator=generator).tolist()
        core.add_request(EngineRequest(f"r{i}", tuple(prompt), params))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.running) or core.scheduler.waiting:
        core.step()                                                   # prefill, untimed

    launch_times = []
    original = runner.launch

    def timed_launch(*a, **k):
        started = time.perf_counter()
        out = original(*a, **k)
        launch_times.append(time.perf_counter() - started)
        return out

    runner.launch = timed_launch
    step_times = []
    try:
        for i in range(warmup + steps):
            started = time.perf_counter()
            outputs = core.step()
            elapsed = time.perf_counter() - started
            if i >= warmup:
                if len(outputs) != batch:
                    raise RuntimeError(f"step gave {len(outputs)} tokens for a batch of {batch}")
                step_times.append(elapsed)
    finally:
        runner.launch = original
    launch_times = launch_times[warmup:]
    gpu_ms = graph_gpu_ms(runner, batch)
    core.abort(list(core.requests))
    step_ms = statistics.median(step_times) * 1000
    return {"batch": batch, "context": context, "step_ms": step_ms,
            "step_ms_quartiles": [q * 1000 for q in statistics.quantiles(step_times, n=4)],
            "launch_ms": statistics.median(launch_times) * 1000, "gpu_ms": gpu_ms,
            "host_ms": None if gpu_ms is None else step_ms - gpu_ms,
            "tokens_per_s": batch / (step_ms / 1000), "step_ms_samples": [t * 1000 for t in step_times]}


def graph_gpu_ms(runner, batch: int, repetitions: int = 20) -> float | None:
    """The captured graph's own time (its inputs are still those of the last step), replayed back to back."""
    import torch

    from flare.engine.cuda_graphs import bucket_for

    graphs = runner.graphs
    if graphs is None or not graphs.capture:
        return None
    graph = graphs.graphs[bucket_for(batch, graphs.sizes)]
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    graph.replay()
    start.record()
    for _ in range(repetitions):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repetitions


if __name__ == "__main__":
    sys.exit(main())
