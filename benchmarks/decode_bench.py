#!/usr/bin/env python
"""Decode-step latency of a benchmark architecture with random weights, without a checkpoint on disk.

The same harness and target as `ignition bench` (flare.bench, flare.bench_model): real prefilled
contexts, one decode step (forward, logits, greedy sampling) replayed as a CUDA graph, CUDA-event
timing, median and IQR per case. Weights are random in GPU memory (decode speed does not depend on
their values), which saves writing and reading 16 GB when only the step's speed is asked.

    python benchmarks/decode_bench.py llama-8b --batches 1,8,32 --contexts 512,2048 --output out.json
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from shapes import SHAPES, randomize_  # noqa: E402


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--contexts", default="512,2048")
    parser.add_argument("--warmup", default="5")
    parser.add_argument("--repetitions", default="20")
    parser.add_argument("--seeds", default="0,1")
    parser.add_argument("--no-graph", action="store_true", help="time the eager step instead of a graph replay")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)

    import torch

    from flare.bench import (BenchConfig, cuda_event_timer, device_identity, parse_int_list, positive_int,
                             run_bench)
    from flare.bench_model import ModelDecodeTarget
    from flare.engine.attention_triton import TritonBackend
    from flare.models import ModelConfig, build_model

    config = BenchConfig(batches=parse_int_list(args.batches, "--batches"),
                         contexts=parse_int_list(args.contexts, "--contexts", multiple_of=128),
                         warmup=positive_int(args.warmup, "--warmup"),
                         repetitions=positive_int(args.repetitions, "--repetitions"),
                         seeds=parse_int_list(args.seeds, "--seeds", allow_zero=True))
    cfg = ModelConfig.from_hf_config(SHAPES[args.shape])
    model = build_model(cfg, torch.bfloat16, "cuda", TritonBackend())
    randomize_(model)
    target = ModelDecodeTarget(model, cfg, max_batch=max(config.batches), max_context=max(config.contexts),
                               graph=not args.no_graph)
    weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
    result = run_bench(target, config, cuda_event_timer(), device=device_identity(),
                       configuration={"model": args.shape, "weights": "random bf16 (std 0.02)",
                                      "weight_bytes": weight_bytes, "attention": "triton",
                                      "graphs": not args.no_graph, "sampling": "greedy", "page_size": 16},
                       output=args.output, progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(result.table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
