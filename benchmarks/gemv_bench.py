#!/usr/bin/env python
"""Decode GEMV micro-benchmark on a GPU: flare's gemv kernel against F.linear (cuBLAS), bf16 weights.

For each projection of llama-8b and qwen3-8b and each row count (decode batch), times F.linear and a
small sweep of GemvConfigs. Timing: 20 back-to-back calls captured in one CUDA graph, replayed several
times, median per call; the calls rotate over enough weight copies that together exceed L2 several
times, so every call reads its weight from device memory. Every config is first checked against a
float32 reference (bf16 tolerance); one that fails to compile or to match is reported and skipped.
Prints a table and the projected GEMV time of a decode step at one row (layers x per-layer shapes +
lm_head), and writes everything as JSON.

    python benchmarks/gemv_bench.py --output benchmarks/results/gemv.json
    python benchmarks/gemv_bench.py --models llama-8b --rows 1      # a quicker subset
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

MODELS = {  # name: (layers, [(projection, N, K)])
    "llama-8b": (32, [("qkv", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up", 28672, 4096),
                      ("down", 4096, 14336), ("lm_head", 128256, 4096)]),
    "qwen3-8b": (36, [("qkv", 6144, 4096), ("o_proj", 4096, 4096), ("gate_up", 24576, 4096),
                      ("down", 4096, 12288), ("lm_head", 151936, 4096)]),
}
ROWS = (1, 2, 4, 8)
CALLS_PER_GRAPH = 20
REPLAYS = 7
TOLERANCE = 1e-2                                # bf16 output rounding is ~4e-3 relative

# (block_n, block_k, num_warps, num_stages): few enough that the sweep compiles in well under a minute.
# fma loads are not software-pipelined (only loads feeding tl.dot are), so its bytes in flight come from
# wide tiles and several programs per SM; dot tiles get cp.async stages, and wgmma needs block_n >= 64.
FMA_TILES = [(16, 256, 4, 3), (32, 256, 4, 3), (16, 512, 4, 3), (32, 512, 8, 3), (64, 256, 8, 3), (8, 512, 4, 3)]
DOT_TILES = [(64, 128, 4, 4), (64, 256, 4, 3), (64, 256, 4, 4), (128, 128, 8, 3), (32, 256, 4, 4)]
FMA_REGISTER_BUDGET = 64                        # fp32 partial sums per thread the fma path may hold


def sweep_configs(rows: int, n: int, k: int) -> list:
    """fma tiles that fit the register budget at this row count, and tensor-core tiles; each unsplit
    and at the split the default heuristic picks for its tile width."""
    import triton

    from flare.kernels.gemv import GemvConfig, choose_split_k, default_config

    tiles = [(bn, bk, w, s, False) for bn, bk, w, s in FMA_TILES
             if bn * triton.next_power_of_2(rows) * bk / (32 * w) <= FMA_REGISTER_BUDGET]
    tiles += [(bn, bk, w, s, True) for bn, bk, w, s in DOT_TILES]
    configs = []
    for block_n, block_k, warps, stages, use_dot in tiles:
        splits = sorted({1, choose_split_k(n, k, block_n)})
        configs += [GemvConfig(block_n=block_n, block_k=block_k, split_k=split, use_dot=use_dot,
                               num_warps=warps, num_stages=stages) for split in splits]
    default = default_config(rows, n, k)
    return configs if default in configs else [default, *configs]


def graph_time_us(calls: list) -> float:
    """Median time of one call, from CUDA-graph replays of CALLS_PER_GRAPH calls cycling over `calls`."""
    import torch

    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):                 # warm-up off the default stream, as capture advises
        for call in calls:
            call()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(CALLS_PER_GRAPH):
            calls[i % len(calls)]()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    samples = []
    for _ in range(REPLAYS):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) * 1000 / CALLS_PER_GRAPH)
    del graph
    return statistics.median(samples)


def copy_bandwidth_tbps() -> float:
    """Device-to-device copy of 1 GiB, counting bytes read plus written: the practical ceiling."""
    import torch

    src = torch.empty(1 << 30, dtype=torch.uint8, device="cuda").random_()
    dst = torch.empty_like(src)
    us = graph_time_us([lambda: dst.copy_(src)])
    return 2 * src.numel() / us / 1e6


def relative_error(out, ref) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def bench_shape(n: int, k: int, rows: int, l2_bytes: int) -> dict:
    from dataclasses import asdict

    import torch
    import torch.nn.functional as F

    from flare.kernels.gemv import gemv

    weight_bytes = n * k * 2
    copies = max(2, math.ceil(4 * l2_bytes / weight_bytes))
    gen = torch.Generator(device="cuda").manual_seed(n * 31 + k + rows)
    weights = [torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) / 64 for _ in range(copies)]
    x = torch.randn(rows, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    ref = x.float() @ weights[0].float().T
    moved = weight_bytes + rows * (k + n) * 2

    def rate(us):
        return moved / us / 1e6                   # TB/s

    cublas_us = graph_time_us([lambda w=w: F.linear(x, w) for w in weights])
    record = {"n": n, "k": k, "rows": rows, "bytes": moved, "weight_copies": copies,
              "cublas_us": cublas_us, "cublas_tbps": rate(cublas_us),
              "cublas_error": relative_error(F.linear(x, weights[0]), ref), "configs": []}
    for config in sweep_configs(rows, n, k):
        entry = {"config": asdict(config)}
        try:
            error = relative_error(gemv(x, weights[0], None, config), ref)
            entry["error"] = error
            if not error < TOLERANCE:
                entry["failed"] = f"relative error {error:.2e} over {TOLERANCE}"
            else:
                entry["us"] = graph_time_us([lambda w=w: gemv(x, w, None, config) for w in weights])
                entry["tbps"] = rate(entry["us"])
        except Exception as exc:                  # a config that cannot compile or launch is skipped
            entry["failed"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
        record["configs"].append(entry)
    timed = [c for c in record["configs"] if "us" in c]
    if timed:
        best = min(timed, key=lambda c: c["us"])
        record.update(best=best["config"], ours_us=best["us"], ours_tbps=best["tbps"],
                      speedup=cublas_us / best["us"])
    del weights
    torch.cuda.empty_cache()
    return record


def config_label(config: dict) -> str:
    kind = "dot" if config["use_dot"] else "fma"
    return (f"{kind} n{config['block_n']} k{config['block_k']} s{config['split_k']} "
            f"w{config['num_warps']} st{config['num_stages']}")


def print_table(records: list) -> None:
    print(f"\n{'model':9} {'proj':8} {'N':>6} {'K':>6} {'rows':>4} {'cuBLAS us':>9} {'TB/s':>5} "
          f"{'ours us':>8} {'TB/s':>5} {'speedup':>7}  best config (failed/tried)")
    for r in records:
        failed = sum("failed" in c for c in r["configs"])
        ours = (f"{r['ours_us']:8.1f} {r['ours_tbps']:5.2f} {r['speedup']:7.2f}" if "best" in r
                else f"{'-':>8} {'-':>5} {'-':>7}")
        best = config_label(r["best"]) if "best" in r else "none"
        print(f"{r['model']:9} {r['proj']:8} {r['n']:6} {r['k']:6} {r['rows']:4} {r['cublas_us']:9.1f} "
              f"{r['cublas_tbps']:5.2f} {ours}  {best} ({failed}/{len(r['configs'])})")


def projected_step(records: list) -> dict:
    """GEMV time of one decode step at one row: layers x (qkv, o, gate_up, down) + lm_head."""
    totals = {}
    for model, (layers, shapes) in MODELS.items():
        rows1 = {r["proj"]: r for r in records if r["model"] == model and r["rows"] == 1}
        if len(rows1) != len(shapes) or any("best" not in r for r in rows1.values()):
            continue
        def total(key):
            return sum(rows1[p][key] * (1 if p == "lm_head" else layers) for p, _, _ in shapes)
        totals[model] = {"layers": layers, "cublas_ms": total("cublas_us") / 1000,
                         "ours_ms": total("ours_us") / 1000}
    return totals


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--rows", nargs="+", type=int, default=list(ROWS))
    parser.add_argument("--output", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)

    import torch
    import triton

    if not torch.cuda.is_available():
        print("gemv_bench needs a CUDA GPU", file=sys.stderr)
        return 1
    props = torch.cuda.get_device_properties(0)
    l2_bytes = getattr(props, "L2_cache_size", 50 << 20) or (50 << 20)
    began = time.time()
    copy_tbps = copy_bandwidth_tbps()
    print(f"{props.name}: {props.multi_processor_count} SMs, L2 {l2_bytes >> 20} MiB, "
          f"copy {copy_tbps:.2f} TB/s (read+write); torch {torch.__version__}, triton {triton.__version__}",
          flush=True)
    records, seen = [], {}
    for model in args.models:
        for proj, n, k in MODELS[model][1]:
            for rows in args.rows:
                if (n, k, rows) in seen:          # the two models share shapes: time them once
                    records.append({**seen[(n, k, rows)], "model": model, "proj": proj})
                    continue
                record = {"model": model, "proj": proj, **bench_shape(n, k, rows, l2_bytes)}
                seen[(n, k, rows)] = record
                records.append(record)
                print(f"  {model} {proj} rows={rows}: cuBLAS {record['cublas_us']:.1f} us, "
                      f"ours {record.get('ours_us', float('nan')):.1f} us  [{time.time() - began:.0f}s]",
                      flush=True)
    print_table(records)
    totals = projected_step(records)
    for model, t in totals.items():
        print(f"\n{model} decode-step GEMVs at 1 row ({t['layers']} layers + lm_head): cuBLAS "
              f"{t['cublas_ms']:.2f} ms, ours {t['ours_ms']:.2f} ms ({t['cublas_ms'] / t['ours_ms']:.2f}x)")
    print(f"\nfinished in {time.time() - began:.0f}s")
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps({
            "device": props.name, "torch": torch.__version__, "triton": triton.__version__,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "copy_tbps": copy_tbps,
            "calls_per_graph": CALLS_PER_GRAPH, "replays": REPLAYS,
            "results": records, "projected_decode_step": totals}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
