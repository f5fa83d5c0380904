#!/usr/bin/env python
"""Verification-round cost by width: `ignition bench --verify-width W` for W = 1 .. 8 in one process.

    python benchmarks/verify_width_bench.py CHECKPOINT --widths 1-8 --batches 1,8,32 --contexts 1024 \
        --output $OUT/verify_width.json

Loads and compiles the model once (as `ignition bench` does: Triton attention, compiled decoder layers,
each case captured as a CUDA graph), then runs the bench harness (flare.bench) at every width: width 1
is the plain decode step (flare.bench_model), wider ones complete speculative rounds
(flare.bench_speculation: W target tokens per request, sampling, acceptance, commit). Random weights
measure cost only. Prints each width's median per case and its ratio to width 1 (the target: width 8
at batch 1 within 1.15x), and writes every run's JSON under one document.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "src"))


def parse_widths(text: str) -> list[int]:
    if "-" in text:
        low, high = (int(part) for part in text.split("-"))
        return list(range(low, high + 1))
    return [int(part) for part in text.split(",")]


def main() -> int:
    import torch

    from flare.bench import BenchConfig, cuda_event_timer, device_identity, parse_int_list, run_bench
    from flare.bench_model import ModelDecodeTarget
    from flare.bench_speculation import SpeculativeRoundTarget
    from flare.engine.attention_triton import TritonBackend
    from flare.engine.compile import compile_model
    from flare.models import load_checkpoint

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("checkpoint", type=Path)
    parser.add_argument("--widths", default="1-8")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--contexts", default="1024")
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repetitions", type=int, default=20)
    parser.add_argument("--seeds", default="0")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args()
    widths = parse_widths(args.widths)
    config = BenchConfig(batches=parse_int_list(args.batches, "--batches"),
                         contexts=parse_int_list(args.contexts, "--contexts", multiple_of=128),
                         warmup=args.warmup, repetitions=args.repetitions,
                         seeds=parse_int_list(args.seeds, "--seeds", allow_zero=True))
    started = time.perf_counter()
    cfg, model = load_checkpoint(args.checkpoint, torch.bfloat16, "cuda", TritonBackend())
    compile_model(model)
    print(f"loaded and compiled in {time.perf_counter() - started:.1f} s", flush=True)
    runs, medians = {}, {}
    for width in widths:
        common = dict(max_batch=max(config.batches), max_context=max(config.contexts))
        target = (ModelDecodeTarget(model, cfg, **common) if width == 1
                  else SpeculativeRoundTarget(model, cfg, width=width, **common))
        run = run_bench(target, config, cuda_event_timer(), device=device_identity(),
                        configuration={"checkpoint": str(args.checkpoint), "verify_width": width,
                                       "draft_tokens": width - 1, "graphs": True, "sampling": "greedy"},
                        progress=lambda line, w=width: print(f"width {w}: {line}", flush=True))
        runs[width] = run.to_json()
        medians[width] = {(case["batch"], case["context"]): case["median_ms"] for case in runs[width]["cases"]}
        del target
        torch.cuda.empty_cache()
    lines = [f"{'batch':>5} {'context':>7} " + " ".join(f"{'W' + str(w):>8}" for w in widths) + "   (median ms; ratio to W1)"]
    for batch, context in config.cases:
        base = medians[widths[0]][batch, context]
        cells = [f"{medians[w][batch, context]:>8.3f}" for w in widths]
        ratios = [f"{medians[w][batch, context] / base:>8.2f}" for w in widths]
        lines.append(f"{batch:>5} {context:>7} " + " ".join(cells))
        lines.append(f"{'':>5} {'ratio':>7} " + " ".join(ratios))
    print("\n".join(lines))
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps({"benchmark": "verify_width", "widths": widths,
                                           "table": lines, "runs": {str(w): runs[w] for w in widths}}, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
