#!/usr/bin/env python
"""Multi-query decode attention on a GPU (a few new tokens per sequence against its paged context: the
steps of speculative verification) against the flash prefill kernel those steps took before, at
llama-8b's attention shape (32 query heads, 8 KV heads, head_dim 128, page size 16, pages shuffled
through the cache), bf16.

One job in one go (about two minutes on an H200):
  1. correctness: multi_query_attention at its default launch against the float32 torch reference
     (1 + k tokens for k in 1, 3, 8, 15 over ragged contexts, the bf16 and the FP8 cache);
  2. cases: batches 1, 8 and 32 of 2, 4 and 9 new tokens each over 2,048- and 32,768-token contexts;
     every launch of the sweep (context tokens per step, warps, stages, split count around
     choose_num_splits') is first checked against the flash prefill kernel's output, then timed with
     CUDA events (median of several runs);
  3. prints a table (ms, and GB/s of K/V read: the cache bytes of the context once, the floor of a
     memory-bound step) with the best launch per case, the default's time and the flash prefill
     kernel's, the best launch overall (geometric mean over the cases), and writes everything as JSON.

    python3 benchmarks/multi_query_bench.py --output $OUT/multi_query.json
    python3 benchmarks/multi_query_bench.py --smoke      # tiny shapes on any device: a script check
"""

from __future__ import annotations

import argparse
import itertools
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from prefill_attention_bench import (bench_device, fastest_variant, print_failures, relative_error,  # noqa: E402
                                     timer, write_document)

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16           # llama-8b / qwen3-8b attention shape
BATCHES, QUERIES, CONTEXTS = (1, 8, 32), (2, 4, 9), (2048, 32768)
SMOKE = dict(batches=(1, 3), queries=(2, 3), contexts=(40,), heads=4, kv_heads=2, dim=64)
TOLERANCE = 1e-2                                           # bf16 outputs against float32 or the flash kernel


def launches(smoke: bool) -> list[dict]:
    """The sweep: tokens per inner step, warps, stages (None: Triton's default) and the split count as a
    factor of choose_num_splits' (rounded, at least 1). The first entry is the backend's default."""
    if smoke:
        return [dict(block_n=None, num_warps=4, num_stages=None, split_factor=1.0),
                dict(block_n=16, num_warps=4, num_stages=None, split_factor=2.0)]
    default = dict(block_n=None, num_warps=4, num_stages=None, split_factor=1.0)
    grid = [dict(block_n=n, num_warps=w, num_stages=s, split_factor=f)
            for n, w, s, f in itertools.product((32, 64, 128), (4, 8), (2, 3), (0.5, 1.0, 2.0))]
    return [default] + grid


def label(launch: dict) -> str:
    return (f"n{launch['block_n'] or 'default'} w{launch['num_warps']} s{launch['num_stages'] or 'default'} "
            f"x{launch['split_factor']:g}")


def paged_batch(batch: int, queries: int, context: int, dtype, device, generator, heads=HEADS, kv_heads=KV_HEADS,
                dim=HEAD_DIM) -> dict:
    """`batch` sequences of `context` tokens (the last `queries` new), their pages shuffled through one cache."""
    import torch

    pages = -(-context // PAGE)
    kv = torch.randn(2, batch * pages + 1, PAGE, kv_heads, dim, generator=generator, device=device).to(dtype)
    order = torch.randperm(batch * pages + 1, generator=generator, device=device)[:batch * pages].int()
    return {"q": torch.randn(batch * queries, heads, dim, generator=generator, device=device).to(dtype),
            "kv": kv, "page_tables": order.view(batch, pages).contiguous(),
            "seq_lens": torch.full((batch,), context, dtype=torch.int32, device=device),
            "query_start_loc": torch.arange(0, (batch + 1) * queries, queries, dtype=torch.int32, device=device),
            "batch": batch, "queries": queries, "context": context}


def check_correctness(device, dtype, smoke: bool) -> list:
    """The default launch against the float32 reference, over ragged contexts and both caches."""
    import torch

    from flare.engine.attention import fp8_kv_views, quantize_kv
    from flare.kernels.decode_attention import choose_num_splits
    from flare.kernels.multi_query_attention import multi_query_attention, multi_query_attention_reference

    generator = torch.Generator(device=device).manual_seed(7)
    heads, kv_heads, dim = (4, 2, 64) if smoke else (HEADS, KV_HEADS, HEAD_DIM)
    contexts = [20, 37, 300] if smoke else [20, 700, 4097, 16]
    rows = []
    for queries, fp8 in itertools.product((2, 4) if smoke else (2, 4, 9, 16), (False, True)):
        lens = [max(c, queries) for c in contexts]
        pages = [-(-length // PAGE) for length in lens]
        kv = torch.randn(2, sum(pages) + 1, PAGE, kv_heads, dim, generator=generator, device=device)
        order = torch.randperm(sum(pages) + 1, generator=generator, device=device).int()
        tables = torch.zeros(len(lens), max(pages), dtype=torch.int32, device=device)
        for i, (taken, count) in enumerate(zip(itertools.accumulate([0] + pages), pages)):
            tables[i, :count] = order[taken:taken + count]
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=device)
        q = torch.randn(len(lens) * queries, heads, dim, generator=generator, device=device).to(dtype)
        scales = {}
        if fp8:
            raw = torch.zeros(2, kv.shape[1], PAGE, kv_heads * (dim + 4), dtype=torch.uint8, device=device)
            views = fp8_kv_views(raw, kv_heads, dim)
            for values, scale, part in ((views.k, views.k_scale, kv[0]), (views.v, views.v_scale, kv[1])):
                quantized, s = quantize_kv(part)
                values.copy_(quantized)
                scale.copy_(s)
            caches = ref_caches = (views.k, views.v)
            scales = {"k_scale": views.k_scale, "v_scale": views.v_scale}
        else:
            caches = (kv[0].to(dtype), kv[1].to(dtype))
            ref_caches = (caches[0].float(), caches[1].float())
        splits = choose_num_splits(len(lens), kv_heads, max(lens))
        out = multi_query_attention(q, *caches, tables, seq_lens, dim ** -0.5, splits, **scales)
        ref = multi_query_attention_reference(q.float(), *ref_caches, tables, seq_lens, dim ** -0.5, **scales)
        error = relative_error(out, ref)
        rows.append({"queries": queries, "fp8_kv": fp8, "splits": splits, "rel_error": error, "ok": error < TOLERANCE})
    return rows


def bench_case(batch, queries, context, dtype, device, sweep, measure, generator, smoke: bool) -> dict:
    import torch

    from flare.kernels.decode_attention import choose_num_splits
    from flare.kernels.flash_prefill import flash_prefill_attention
    from flare.kernels.multi_query_attention import multi_query_attention

    dims = {k: SMOKE[k] for k in ("heads", "kv_heads", "dim")} if smoke else {}
    case = paged_batch(batch, queries, context, dtype, device, generator, **dims)
    q, kv, tables, seq_lens = case["q"], case["kv"], case["page_tables"], case["seq_lens"]
    scale = q.shape[2] ** -0.5
    kv_bytes = 2 * batch * context * kv.shape[3] * kv.shape[4] * kv.element_size()

    def flash():
        return flash_prefill_attention(q, kv[0], kv[1], case["query_start_loc"], seq_lens, tables, scale,
                                       max_query_len=queries)

    ref = flash().float()
    default_splits = choose_num_splits(batch, kv.shape[3], context)
    record = {"batch": batch, "queries": queries, "context": context, "kv_bytes": kv_bytes,
              "default_splits": default_splits, "flash_prefill": {"ms": measure(flash)}, "multi_query": []}
    for launch in sweep:
        splits = max(1, round(default_splits * launch["split_factor"]))
        knobs = {k: launch[k] for k in ("block_n", "num_warps", "num_stages")}
        fn = lambda s=splits, k=knobs: multi_query_attention(q, kv[0], kv[1], tables, seq_lens, scale, s, **k)  # noqa: E731
        entry = {"variant": label(launch), "launch": launch, "splits": splits}
        try:
            error = relative_error(fn(), ref)
            entry["rel_error"] = error
            if error < TOLERANCE:
                entry["ms"] = measure(fn)
                entry["gb_per_s"] = kv_bytes / entry["ms"] / 1e6
            else:
                entry["failed"] = f"relative error {error:.2e} over {TOLERANCE}"
        except Exception as exc:                   # out of shared memory or registers, a compile failure, ...
            entry["failed"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
        record["multi_query"].append(entry)
    ok = [e for e in record["multi_query"] if "ms" in e]
    record["best"] = min(ok, key=lambda e: e["ms"]) if ok else None
    del case, q, kv
    if device == "cuda":
        torch.cuda.empty_cache()
    return record


def best_overall(records: list) -> dict | None:
    """The launch with the smallest geometric mean of time over all cases."""
    fastest = fastest_variant(records, "multi_query")
    return None if fastest is None else {"variant": fastest[0], "ms": fastest[1]}


def print_table(records: list) -> None:
    print(f"\n{'B':>3} {'Q':>3} {'context':>7} | {'best launch':24} {'ms':>8} {'GB/s':>7} | {'default ms':>10} "
          f"{'GB/s':>7} | {'flash ms':>8} {'x':>6}")
    for r in records:
        best, default, flash = r["best"], r["multi_query"][0], r["flash_prefill"]["ms"]
        best_text = (f"{best['variant']:24} {best['ms']:8.3f} {best['gb_per_s']:7.0f}" if best
                     else f"{'none':24} {'-':>8} {'-':>7}")
        default_text = (f"{default['ms']:10.3f} {default['gb_per_s']:7.0f}" if "ms" in default
                        else f"{'failed':>10} {'-':>7}")
        speedup = f"{flash / default['ms']:6.1f}" if "ms" in default else f"{'-':>6}"
        print(f"{r['batch']:3} {r['queries']:3} {r['context']:7} | {best_text} | {default_text} | {flash:8.3f} {speedup}")
        print_failures(r["multi_query"], "launches")
    print("(x: the flash prefill kernel's time over the default multi-query launch's)")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on whatever device there is")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)

    import torch

    chosen = bench_device("multi_query_bench", args.smoke)
    if chosen is None:
        return 1
    device, dtype = chosen
    began = time.time()
    correctness = check_correctness(device, dtype, args.smoke)
    for row in correctness:
        print(f"correctness Q={row['queries']:<2} fp8_kv={row['fp8_kv']!s:5} splits={row['splits']:<2} "
              f"rel error {row['rel_error']:.2e} {'ok' if row['ok'] else 'FAILED'}", flush=True)
    measure = timer(device)
    generator = torch.Generator(device=device).manual_seed(1)
    sizes = (SMOKE["batches"], SMOKE["queries"], SMOKE["contexts"]) if args.smoke else (BATCHES, QUERIES, CONTEXTS)
    sweep = launches(args.smoke)
    records = []
    for context, batch, queries in itertools.product(sizes[2], sizes[0], sizes[1]):
        records.append(bench_case(batch, queries, context, dtype, device, sweep, measure, generator, args.smoke))
        print(f"  B{batch} Q{queries} context {context}: done [{time.time() - began:.0f}s]", flush=True)
    print_table(records)
    overall = best_overall(records)
    if overall:
        print(f"\nbest launch over all cases: {overall['variant']}")
    print(f"finished in {time.time() - began:.0f}s")
    write_document(args.output, "multi-query decode attention", device, dtype, correctness, records, overall)
    return 0 if all(row["ok"] for row in correctness) else 2


if __name__ == "__main__":
    sys.exit(main())
