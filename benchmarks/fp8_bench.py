#!/usr/bin/env python
"""FP8 weight products on a GPU: flare's FP8 GEMV and GEMM against bf16 cuBLAS, correctness checked.

Decode (rows 1, 8, 32; 32 runs the GEMM, as `torch.ops.flare.fp8_linear` dispatches): for each
projection of llama-8b and qwen3-8b (the LM head stays bf16), F.linear on bf16 weights against the FP8
operator on e4m3 weights with 128x128 block scales (Qwen/DeepSeek, online FP8) and with per-row scales
(compressed-tensors), plus a small sweep of GEMV tiles at rows <= 16. Prompt steps (M = 256, 2048,
8192): the Triton FP8 GEMM (weight-only) against bf16 cuBLAS, dequantize-then-cuBLAS, and the W8A8
candidate torch._scaled_mm (activations quantized per token / per 1x128 group, the quantization timed
with it). Every kernel is checked against the float32 reference of the dequantized weights before it
is timed (bf16 tolerance; W8A8 is reported against the same reference, its own error shown).

Timing as benchmarks/gemv_bench.py: 20 calls in one CUDA graph over weight copies exceeding L2 several
times, median of 7 replays. Prints tables and the projected weight-product time of a decode step at one
row (layers x projections + the bf16 LM head), writes JSON.

    python3 benchmarks/fp8_bench.py --output $OUT/fp8_bench.json
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from gemv_bench import MODELS, copy_bandwidth_tbps, graph_time_us  # noqa: E402

DECODE_ROWS = (1, 8, 32)
PROMPT_ROWS = (256, 2048, 8192)
LAYOUTS = {"block128": (128, 128), "per-row": (1, 0)}
TOLERANCE = 1e-2
W8A8_TOLERANCE = 6e-2              # activations rounded to e4m3 as well
GEMV_TILES = [(64, 128, 4, 4), (32, 128, 4, 4), (128, 128, 8, 4), (64, 64, 4, 6), (16, 128, 4, 4)]


def relative_error(out, ref) -> float:
    return ((out.float() - ref).norm() / ref.norm()).item()


def fp8_weights(n: int, k: int, row_block: int, col_block: int, copies: int, gen):
    import torch

    from flare.kernels.fp8_reference import E4M3_MAX, scale_grid

    out = []
    for _ in range(copies):
        weight = (torch.randn(n, k, device="cuda", generator=gen) * 100).clamp(-E4M3_MAX, E4M3_MAX)
        scale = torch.rand(scale_grid(n, k, row_block, col_block), device="cuda", generator=gen) * 1e-4 + 1e-5
        out.append((weight.to(torch.float8_e4m3fn), scale))
    return out


def timed(candidates: dict, reference, calls_of, tolerance: float) -> dict:
    """name -> {us, error} (or failed) for each candidate `fn(weight_index) -> out`."""
    results = {}
    for name, (fn, copies, limit) in candidates.items():
        entry = {}
        try:
            error = relative_error(fn(0), reference)
            entry["error"] = error
            if error < (limit or tolerance):
                entry["us"] = graph_time_us(calls_of(fn, copies))
            else:
                entry["failed"] = f"relative error {error:.2e} over {limit or tolerance}"
        except Exception as exc:                  # unsupported here, or cannot compile: reported, skipped
            entry["failed"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
        results[name] = entry
    return results


def bench_shape(n: int, k: int, rows: int, l2_bytes: int) -> dict:
    import torch
    import torch.nn.functional as F

    from flare.kernels import fp8_linear  # noqa: F401  (registers torch.ops.flare.fp8_linear)
    from flare.kernels.fp8_gemm import scaled_mm_linear
    from flare.kernels.fp8_gemv import Fp8GemvConfig, choose_split_k, fp8_gemv
    from flare.kernels.fp8_reference import dequantize

    gen = torch.Generator(device="cuda").manual_seed(n * 31 + k + rows)
    copies = max(2, math.ceil(4 * l2_bytes / (n * k)))
    x = torch.randn(rows, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    bf16 = [torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) / 64
            for _ in range(max(2, math.ceil(4 * l2_bytes / (2 * n * k))))]
    record = {"n": n, "k": k, "rows": rows,
              "cublas_bf16_us": graph_time_us([lambda w=w: F.linear(x, w) for w in bf16]), "layouts": {}}
    del bf16
    calls_of = lambda fn, count: [lambda i=i: fn(i) for i in range(count)]  # noqa: E731
    for layout, (row_block, col_block) in LAYOUTS.items():
        weights = fp8_weights(n, k, row_block, col_block, copies, gen)
        reference = x.float() @ dequantize(*weights[0], row_block, col_block).T
        op = torch.ops.flare.fp8_linear
        candidates = {"flare fp8_linear": (lambda i: op(x, *weights[i], None, row_block, col_block), copies, None)}
        if rows <= 16:
            for bn, bk, warps, stages in GEMV_TILES:
                for split in sorted({1, choose_split_k(n, k, bn)}):
                    for use_dot in (False, True):
                        config = Fp8GemvConfig(block_n=bn, block_k=bk, split_k=split, use_dot=use_dot,
                                               num_warps=warps, num_stages=stages)
                        candidates[f"gemv {asdict(config)}"] = (
                            lambda i, c=config: fp8_gemv(x, *weights[i], row_block, col_block, None, c), copies, None)
        else:
            candidates["dequantize + cuBLAS"] = (
                lambda i: F.linear(x, dequantize(*weights[i], row_block, col_block).to(torch.bfloat16)), copies, None)
            candidates["_scaled_mm W8A8"] = (
                lambda i: scaled_mm_linear(x, *weights[i], row_block, col_block), copies, W8A8_TOLERANCE)
        record["layouts"][layout] = timed(candidates, reference, calls_of, TOLERANCE)
        del weights
        torch.cuda.empty_cache()
    return record


def summarize(record: dict) -> dict:
    out = {}
    for layout, results in record["layouts"].items():
        ok = {name: r["us"] for name, r in results.items() if "us" in r}
        gemv = {name: us for name, us in ok.items() if name.startswith("gemv")}
        moved = record["n"] * record["k"] + record["rows"] * (record["k"] + record["n"]) * 2
        default = ok.get("flare fp8_linear")
        out[layout] = {"default_us": default, "default_tbps": moved / default / 1e6 if default else None,
                       "best_gemv_us": min(gemv.values()) if gemv else None,
                       "best_gemv": min(gemv, key=gemv.get) if gemv else None,
                       "dequant_cublas_us": ok.get("dequantize + cuBLAS"),
                       "scaled_mm_w8a8_us": ok.get("_scaled_mm W8A8"),
                       "failed": sorted(name for name, r in results.items() if "failed" in r)}
    return out


def print_table(records: list) -> None:
    print(f"\n{'model':9} {'proj':8} {'N':>6} {'K':>6} {'rows':>5} {'bf16 us':>8} | {'layout':9} {'fp8 us':>8} "
          f"{'x bf16':>6} {'best gemv':>9} {'deq+cuBLAS':>10} {'W8A8':>8}")
    for r in records:
        for layout, s in r["summary"].items():
            fp8 = s["default_us"]
            cell = lambda v: f"{v:.1f}" if v else "-"  # noqa: E731
            print(f"{r['model']:9} {r['proj']:8} {r['n']:6} {r['k']:6} {r['rows']:5} {r['cublas_bf16_us']:8.1f} | "
                  f"{layout:9} {cell(fp8):>8} {(r['cublas_bf16_us'] / fp8 if fp8 else 0):6.2f} "
                  f"{cell(s['best_gemv_us']):>9} {cell(s['dequant_cublas_us']):>10} {cell(s['scaled_mm_w8a8_us']):>8}"
                  + (f"  failed: {len(s['failed'])}" if s["failed"] else ""))


def projected_step(records: list, lm_head: dict) -> dict:
    """Weight products of one decode step at one row: layers x FP8 projections + the bf16 LM head."""
    totals = {}
    for model, (layers, _) in MODELS.items():
        rows1 = [r for r in records if r["model"] == model and r["rows"] == 1]
        if not rows1 or model not in lm_head:
            continue
        totals[model] = {"bf16_ms": (layers * sum(r["cublas_bf16_us"] for r in rows1) + lm_head[model]) / 1000}
        for layout in LAYOUTS:
            values = [r["summary"][layout]["default_us"] for r in rows1]
            if all(values):
                totals[model][f"fp8_{layout}_ms"] = (layers * sum(values) + lm_head[model]) / 1000
    return totals


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--rows", nargs="+", type=int, default=list(DECODE_ROWS + PROMPT_ROWS))
    parser.add_argument("--output", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)

    import torch
    import torch.nn.functional as F
    import triton

    if not torch.cuda.is_available():
        print("fp8_bench needs a CUDA GPU", file=sys.stderr)
        return 1
    props = torch.cuda.get_device_properties(0)
    l2_bytes = getattr(props, "L2_cache_size", 50 << 20) or (50 << 20)
    began = time.time()
    copy_tbps = copy_bandwidth_tbps()
    print(f"{props.name} (sm{props.major}{props.minor}): {props.multi_processor_count} SMs, copy {copy_tbps:.2f} "
          f"TB/s; torch {torch.__version__} (CUDA {torch.version.cuda}), triton {triton.__version__}", flush=True)
    records, seen, lm_head = [], {}, {}
    for model in args.models:
        for proj, n, k in MODELS[model][1]:
            if proj == "lm_head":                 # stays bf16: its cuBLAS time goes into the projection
                w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16)
                x = torch.randn(1, k, device="cuda", dtype=torch.bfloat16)
                lm_head[model] = graph_time_us([lambda: F.linear(x, w)])
                del w
                continue
            for rows in args.rows:
                if (n, k, rows) not in seen:
                    seen[(n, k, rows)] = bench_shape(n, k, rows, l2_bytes)
                record = {"model": model, "proj": proj, **seen[(n, k, rows)]}
                record["summary"] = summarize(record)
                records.append(record)
                s = record["summary"]
                print(f"  {model} {proj} rows={rows}: bf16 {record['cublas_bf16_us']:.1f} us, fp8 "
                      + ", ".join(f"{layout} {v['default_us'] or float('nan'):.1f} us" for layout, v in s.items())
                      + f"  [{time.time() - began:.0f}s]", flush=True)
    print_table(records)
    totals = projected_step(records, lm_head)
    for model, t in totals.items():
        print(f"\n{model} decode-step weight products at 1 row: " + ", ".join(f"{k} {v:.2f}" for k, v in t.items()))
    print(f"\nfinished in {time.time() - began:.0f}s")
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps({
            "device": props.name, "capability": f"{props.major}.{props.minor}", "torch": torch.__version__,
            "cuda": torch.version.cuda, "triton": triton.__version__,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "copy_tbps": copy_tbps,
            "results": records, "lm_head_bf16_us": lm_head, "projected_decode_step": totals}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
