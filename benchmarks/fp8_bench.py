#!/usr/bin/env python
"""FP8 weight products on a GPU: flare's FP8 routes against bf16 cuBLAS, correctness checked.

For each projection of llama-8b and qwen3-8b (the LM head stays bf16), F.linear on bf16 weights against
`torch.ops.flare.fp8_linear` on e4m3 weights with 128x128 block scales (Qwen/DeepSeek, online FP8) and
with per-row scales (compressed-tensors), at the rows each route serves (flare.kernels.routing): the GEMV
(rows 1, 8, 16), W8A8 torch._scaled_mm from W8A8_MIN_ROWS (17, 24, 32 ... 2048). Beside the routed operator, at
every row count the W8A8 product (activations quantized per token / per 1x128 group by our Triton pass,
timed with it), and past the GEMV's rows the weight-only routes: the Triton GEMM with its default tiles
("gemm") and the fused dequantize kernel into the shared buffer followed by cuBLAS ("deq+cuBLAS"). At
the skinny rows a few GEMM configs around the default (flare.kernels.fp8_gemm.candidates) are swept and
the best printed; `--gemv-sweep` adds the GEMV tile sweep at rows <= 16. Every kernel is checked against
the float32 reference of the dequantized weights before it is timed (bf16 tolerance; W8A8 against the
same reference with a looser bound, its own error shown). The summary suggests DEQUANTIZE_MIN_ROWS (the
fewest rows from which deq+cuBLAS beats the Triton GEMM summed over the projections) and W8A8_MIN_ROWS
(the fewest from which W8A8 beats the fastest weight-only route).

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

DECODE_ROWS = (1, 8, 16)
W8A8_ROWS = (17, 24)                # past the GEMV: the W8A8 route from its first row count
SKINNY_ROWS = (32, 64, 128)            # the GEMM config sweep's rows
PROMPT_ROWS = (256, 2048)
LAYOUTS = {"block128": (128, 128), "per-row": (1, 0)}
TOLERANCE = 1e-2
W8A8_TOLERANCE = 6e-2              # activations rounded to e4m3 as well
GEMV_TILES = [(64, 128, 4, 4), (128, 128, 8, 4), (128, 128, 8, 3), (128, 128, 8, 6), (128, 128, 16, 4),
              (256, 128, 8, 4), (256, 128, 16, 4), (128, 256, 8, 4), (64, 256, 4, 4), (32, 128, 4, 4)]


def gemv_sweep_configs(rows: int, n: int, k: int):
    """The GEMV tiles of the sweep (fma at one or two rows, tensor cores beyond), each at half, once and
    twice its default split of K, the split partials summed by the reduce kernel and inside the GEMV."""
    from flare.kernels.fp8_gemv import Fp8GemvConfig, choose_split_k

    for bn, bk, warps, stages in GEMV_TILES:
        split = choose_split_k(n, k, bn)
        for split_k in sorted({max(1, split // 2), split, min(16, split * 2)}):
            for fused in (False, True) if split_k > 1 else (False,):
                yield Fp8GemvConfig(block_n=bn, block_k=bk, split_k=split_k, use_dot=rows > 2,
                                    num_warps=warps, num_stages=stages, fused_reduce=fused)


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


def config_name(config) -> str:
    c = config
    return f"{c.block_m}x{c.block_n}x{c.block_k} split{c.split_k} w{c.num_warps}s{c.num_stages}"


def bench_shape(n: int, k: int, rows: int, l2_bytes: int, gemv_sweep: bool) -> dict:
    import torch
    import torch.nn.functional as F

    from flare.kernels import fp8_linear  # noqa: F401  (registers torch.ops.flare.fp8_linear)
    from flare.kernels.fp8_dequantize import dequantize_linear
    from flare.kernels.fp8_gemm import candidates, fp8_gemm
    from flare.kernels.fp8_gemv import fp8_gemv
    from flare.kernels.fp8_reference import dequantize
    from flare.kernels.fp8_w8a8 import w8a8_linear
    from flare.kernels.routing import MAX_ROWS, fp8_route

    gen = torch.Generator(device="cuda").manual_seed(n * 31 + k + rows)
    copies = max(2, math.ceil(4 * l2_bytes / (n * k)))
    x = torch.randn(rows, k, device="cuda", generator=gen, dtype=torch.bfloat16)
    bf16 = [torch.randn(n, k, device="cuda", generator=gen, dtype=torch.bfloat16) / 64
            for _ in range(max(2, math.ceil(4 * l2_bytes / (2 * n * k))))]
    record = {"n": n, "k": k, "rows": rows, "route": fp8_route(rows),
              "cublas_bf16_us": graph_time_us([lambda w=w: F.linear(x, w) for w in bf16]), "layouts": {}}
    del bf16
    calls_of = lambda fn, count: [lambda i=i: fn(i) for i in range(count)]  # noqa: E731
    for layout, (row_block, col_block) in LAYOUTS.items():
        weights = fp8_weights(n, k, row_block, col_block, copies, gen)
        reference = x.float() @ dequantize(*weights[0], row_block, col_block).T
        op = torch.ops.flare.fp8_linear
        routed_limit = W8A8_TOLERANCE if record["route"] == "w8a8" else None
        candidates_ = {"flare fp8_linear": (lambda i: op(x, *weights[i], None, row_block, col_block), copies,
                                            routed_limit)}
        if rows <= MAX_ROWS and gemv_sweep:
            for config in gemv_sweep_configs(rows, n, k):
                candidates_[f"gemv {asdict(config)}"] = (
                    lambda i, c=config: fp8_gemv(x, *weights[i], row_block, col_block, None, c), copies, None)
        if rows > MAX_ROWS:                       # the weight-only routes, whichever the operator took
            candidates_["gemm"] = (lambda i: fp8_gemm(x, *weights[i], row_block, col_block), copies, None)
            candidates_["deq+cuBLAS"] = (
                lambda i: dequantize_linear(x, *weights[i], row_block, col_block), copies, None)
        if rows in SKINNY_ROWS:
            for config in candidates(rows, n, k)[1:]:                   # the first is the default
                candidates_[f"gemm {config_name(config)}"] = (
                    lambda i, c=config: fp8_gemm(x, *weights[i], row_block, col_block, None, c), copies, None)
        candidates_["_scaled_mm W8A8"] = (
            lambda i: w8a8_linear(x, *weights[i], row_block, col_block), copies, W8A8_TOLERANCE)
        record["layouts"][layout] = timed(candidates_, reference, calls_of, TOLERANCE)
        del weights
        torch.cuda.empty_cache()
    if rows in SKINNY_ROWS:                                         # the "gemm" candidate ran the default
        record["default_config"] = config_name(candidates(rows, n, k)[0])
    return record


def summarize(record: dict) -> dict:
    """Per layout: the routed operator, and each route timed on its own (None where not run)."""
    out = {}
    for layout, results in record["layouts"].items():
        ok = {name: r["us"] for name, r in results.items() if "us" in r}
        default = ok.get("flare fp8_linear")
        gemv = {name: us for name, us in ok.items() if name.startswith("gemv")}
        sweep = {name: us for name, us in ok.items() if name.startswith("gemm ")}
        if record.get("default_config") and ok.get("gemm"):
            sweep[f"gemm {record['default_config']}"] = ok["gemm"]
        moved = record["n"] * record["k"] + record["rows"] * (record["k"] + record["n"]) * 2
        out[layout] = {"default_us": default, "default_tbps": moved / default / 1e6 if default else None,
                       "gemm_us": ok.get("gemm"), "dequant_cublas_us": ok.get("deq+cuBLAS"),
                       "best_gemv_us": min(gemv.values()) if gemv else None,
                       "best_gemv": min(gemv, key=gemv.get) if gemv else None,
                       "best_gemm_us": min(sweep.values()) if sweep else None,
                       "best_gemm": min(sweep, key=sweep.get) if sweep else None,
                       "scaled_mm_w8a8_us": ok.get("_scaled_mm W8A8"),
                       "failed": sorted(name for name, r in results.items() if "failed" in r)}
    return out


def print_table(records: list) -> None:
    cell = lambda v: f"{v:.1f}" if v else "-"  # noqa: E731
    print(f"\n{'model':8} {'proj':7} {'N':>5} {'K':>5} {'rows':>4} {'route':10} {'bf16':>7} | {'layout':8} "
          f"{'fp8':>7} {'x bf16':>6} {'gemm':>7} {'deq+cuB':>7} {'W8A8':>7}  best skinny config")
    for r in records:
        for layout, s in r["summary"].items():
            fp8 = s["default_us"]
            best = f"{s['best_gemm']} {s['best_gemm_us']:.1f}" if s["best_gemm"] else ""
            if s["best_gemv"]:
                best = f"best gemv {s['best_gemv_us']:.1f}"
            print(f"{r['model']:8} {r['proj']:7} {r['n']:5} {r['k']:5} {r['rows']:4} {r['route']:10} "
                  f"{r['cublas_bf16_us']:7.1f} | {layout:8} {cell(fp8):>7} "
                  f"{(r['cublas_bf16_us'] / fp8 if fp8 else 0):6.2f} {cell(s['gemm_us']):>7} "
                  f"{cell(s['dequant_cublas_us']):>7} {cell(s['scaled_mm_w8a8_us']):>7}  {best}"
                  + (f"  failed: {len(s['failed'])}" if s["failed"] else ""))


def suggest_threshold(records: list) -> dict:
    """Per rows (> MAX_ROWS): the Triton GEMM's and deq+cuBLAS's time summed over every projection and
    layout where both ran, and the fewest rows from which deq+cuBLAS is faster (DEQUANTIZE_MIN_ROWS)."""
    totals = {}
    for r in records:
        for s in r["summary"].values():
            if s["gemm_us"] and s["dequant_cublas_us"]:
                entry = totals.setdefault(r["rows"], {"gemm_us": 0.0, "deq_cublas_us": 0.0})
                entry["gemm_us"] += s["gemm_us"]
                entry["deq_cublas_us"] += s["dequant_cublas_us"]
    wins = [t["deq_cublas_us"] < t["gemm_us"] for _, t in sorted(totals.items())]
    crossing = wins.index(True) if True in wins else None
    single = crossing is not None and all(wins[crossing:])          # faster from there on, at every rows run
    return {"by_rows": totals, "dequantize_min_rows": sorted(totals)[crossing] if single else None}


def suggest_w8a8_rows(records: list) -> dict:
    """Per rows: W8A8's time and the fastest weight-only route's (the GEMV up to MAX_ROWS, else the
    better of the GEMM and deq+cuBLAS) summed over every projection and layout where both ran, and the
    fewest rows from which W8A8 is faster at every row count run (W8A8_MIN_ROWS)."""
    from flare.kernels.routing import MAX_ROWS

    totals = {}
    for r in records:
        for s in r["summary"].values():
            weight_only = (s["default_us"] if r["rows"] <= MAX_ROWS
                           else min(v for v in (s["gemm_us"], s["dequant_cublas_us"], 1e30) if v))
            if s["scaled_mm_w8a8_us"] and weight_only < 1e30:
                entry = totals.setdefault(r["rows"], {"w8a8_us": 0.0, "weight_only_us": 0.0})
                entry["w8a8_us"] += s["scaled_mm_w8a8_us"]
                entry["weight_only_us"] += weight_only
    wins = [t["w8a8_us"] < t["weight_only_us"] for _, t in sorted(totals.items())]
    crossing = wins.index(True) if True in wins else None
    single = crossing is not None and all(wins[crossing:])
    return {"by_rows": totals, "w8a8_min_rows": sorted(totals)[crossing] if single else None}


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
    parser.add_argument("--rows", nargs="+", type=int, default=list(DECODE_ROWS + W8A8_ROWS + SKINNY_ROWS + PROMPT_ROWS))
    parser.add_argument("--gemv-sweep", action="store_true", help="also sweep GEMV tiles at rows <= 16 (+~70 s)")
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
                    seen[(n, k, rows)] = bench_shape(n, k, rows, l2_bytes, args.gemv_sweep)
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
    threshold = suggest_threshold(records)
    by_rows = sorted(threshold["by_rows"].items())
    print("\nall projections and layouts, gemm vs deq+cuBLAS us: "
          + ", ".join(f"rows {rows} {t['gemm_us']:.0f} vs {t['deq_cublas_us']:.0f}" for rows, t in by_rows))
    from flare.kernels.routing import DEQUANTIZE_MIN_ROWS
    print(f"suggested DEQUANTIZE_MIN_ROWS: {threshold['dequantize_min_rows']} (now {DEQUANTIZE_MIN_ROWS}; "
          "None: no single crossing among the rows run)")
    w8a8 = suggest_w8a8_rows(records)
    from flare.kernels.routing import W8A8_MIN_ROWS
    print("all projections and layouts, W8A8 vs fastest weight-only us: "
          + ", ".join(f"rows {rows} {t['w8a8_us']:.0f} vs {t['weight_only_us']:.0f}"
                      for rows, t in sorted(w8a8["by_rows"].items())))
    print(f"suggested W8A8_MIN_ROWS: {w8a8['w8a8_min_rows']} (now {W8A8_MIN_ROWS})")
    print(f"\nfinished in {time.time() - began:.0f}s")
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps({
            "device": props.name, "capability": f"{props.major}.{props.minor}", "torch": torch.__version__,
            "cuda": torch.version.cuda, "triton": triton.__version__,
            "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "copy_tbps": copy_tbps,
            "results": records, "lm_head_bf16_us": lm_head, "projected_decode_step": totals,
            "dequantize_threshold": threshold, "w8a8_threshold": w8a8}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
