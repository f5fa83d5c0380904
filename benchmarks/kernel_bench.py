#!/usr/bin/env python
"""Attention kernel micro-benchmark on a GPU: our Triton kernels against torch.

Decode: paged split-K decode attention vs torch (gather the pages, then scaled_dot_product_attention
with GQA), reported as milliseconds and the KV bandwidth achieved (bytes of K and V read / time).
Prefill: paged causal prefill vs SDPA over contiguous K/V (flash attention, no paging: a ceiling),
reported as TFLOP/s. `--fp8-kv` runs decode over an FP8 cache (its bandwidth counts one byte a value
and the scales). Every timed configuration is first checked against the float32 reference.
Prints tables and writes JSON.

    python benchmarks/kernel_bench.py --output results/kernels.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16           # llama-8b / qwen3-8b attention shape


def paged_cache(batch, context, dtype, generator):
    """K/V for `batch` sequences of `context` tokens, pages shuffled through the cache."""
    import torch

    pages_per_seq = -(-context // PAGE)
    num_pages = batch * pages_per_seq
    kv = torch.randn(2, num_pages, PAGE, KV_HEADS, HEAD_DIM, generator=generator, device="cuda").to(dtype)
    order = torch.randperm(num_pages, generator=generator, device="cuda").int()
    page_tables = order.view(batch, pages_per_seq).contiguous()
    return kv, page_tables


def bench_ms(fn):
    import triton.testing

    return triton.testing.do_bench(fn, warmup=50, rep=200, return_mode="median")


def relative_error(out, ref):
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def fp8_cache(kv):
    """The bf16 cache `kv` as the FP8 KV cache stores it: e4m3 values and a float32 scale per token and KV
    head (absolute maximum / 448); with the bf16 cache it stands for, for the reference."""
    import torch

    scales = kv.float().abs().amax(dim=-1).clamp(min=1e-12) / 448.0          # [2, pages, page, Hkv]
    values = (kv.float() / scales[..., None]).to(torch.float8_e4m3fn)
    return values, scales, (values.float() * scales[..., None]).bfloat16()


def decode_sweep(fp8_kv: bool) -> dict:
    """{name: decode_attention knobs} beside the kernel's defaults ("default"): tiles, warps and stages, and
    over an FP8 cache the products in q's dtype (bf16) and twice the splits (key "split_factor")."""
    tiles = ((32, 4), (64, 4), (128, 4), (64, 8), (128, 8))
    variants = {f"n{n}w{w}": dict(block_n=n, num_warps=w) for n, w in tiles}
    variants.update({f"n64w4s{st}": dict(block_n=64, num_stages=st) for st in (1, 2, 4)})
    variants["n128w4s2"] = dict(block_n=128, num_stages=2)
    if not fp8_kv:
        return variants
    variants["n64w4-bf16"] = dict(block_n=64, fp16_math=False)
    variants["n128w8-bf16"] = dict(block_n=128, num_warps=8, fp16_math=False)
    variants.update({"n128w4s2x2": dict(block_n=128, num_stages=2, split_factor=2),
                     "n64w4x2": dict(block_n=64, split_factor=2)})
    return variants


def decode_cases(batches, contexts, sweep, fp8_kv=False):
    import torch
    import torch.nn.functional as F

    from flare.kernels.decode_attention import MAX_SPLITS, choose_num_splits, decode_attention

    generator = torch.Generator(device="cuda").manual_seed(0)
    rows = []
    for batch in batches:
        for context in contexts:
            kv, page_tables = paged_cache(batch, context, torch.bfloat16, generator)
            cache, scales = kv, {}
            if fp8_kv:
                cache, kv_scales, kv = fp8_cache(kv)
                scales = {"k_scale": kv_scales[0], "v_scale": kv_scales[1]}
            q = torch.randn(batch, HEADS, HEAD_DIM, generator=generator, device="cuda").bfloat16()
            seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
            scale = HEAD_DIM ** -0.5
            splits = choose_num_splits(batch, KV_HEADS, context)

            def torch_decode():
                k = kv[0][page_tables.long()].view(batch, -1, KV_HEADS, HEAD_DIM)[:, :context].transpose(1, 2)
                v = kv[1][page_tables.long()].view(batch, -1, KV_HEADS, HEAD_DIM)[:, :context].transpose(1, 2)
                return F.scaled_dot_product_attention(q[:, :, None], k, v, scale=scale,
                                                      enable_gqa=True)[:, :, 0]

            ref = torch_decode().float()
            variants = {"default": {}, **(decode_sweep(fp8_kv) if sweep else {})}
            timings = {}
            for name, knobs in variants.items():
                knobs = dict(knobs)
                num_splits = min(MAX_SPLITS, splits * knobs.pop("split_factor", 1))
                run = lambda: decode_attention(q, cache[0], cache[1], page_tables, seq_lens, scale, num_splits,
                                               **knobs, **scales)
                error = relative_error(run(), ref)
                if not error < 1e-2:
                    raise SystemExit(f"decode B={batch} ctx={context} {name}: error {error}")
                timings[name] = bench_ms(run)
            ours = timings["default"]
            best = min(timings, key=timings.get)
            baseline = bench_ms(torch_decode)
            # bytes of K and V read: bf16 values, or e4m3 values and their float32 scales
            kv_bytes = 2 * batch * context * KV_HEADS * (HEAD_DIM + 4 if fp8_kv else HEAD_DIM * 2)
            rows.append({"batch": batch, "context": context, "splits": splits, "triton_ms": ours,
                         "triton_GBps": kv_bytes / ours / 1e6, "best_variant": best,
                         "best_ms": timings[best], "variants_ms": timings, "torch_ms": baseline,
                         "speedup_vs_torch": baseline / ours, "rel_error_vs_sdpa": error})
            del kv, cache
    return rows


PREFILL_VARIANTS = [dict(block_m=bm, block_n=bn, num_warps=w, num_stages=st)
                    for bm in (64, 128) for bn in (64, 128) for w in (4, 8) for st in (2, 3)]


def prefill_cases(cases, sweep=False):
    import torch
    import torch.nn.functional as F

    from flare.kernels.prefill_attention import prefill_attention

    generator = torch.Generator(device="cuda").manual_seed(1)
    rows = []
    for prefix, chunk in cases:
        context = prefix + chunk
        kv, page_tables = paged_cache(1, context, torch.bfloat16, generator)
        q = torch.randn(chunk, HEADS, HEAD_DIM, generator=generator, device="cuda").bfloat16()
        query_start_loc = torch.tensor([0, chunk], dtype=torch.int32, device="cuda")
        seq_lens = torch.tensor([context], dtype=torch.int32, device="cuda")
        scale = HEAD_DIM ** -0.5
        k = kv[0][page_tables[0].long()].reshape(-1, KV_HEADS, HEAD_DIM)[:context].transpose(0, 1)[None]
        v = kv[1][page_tables[0].long()].reshape(-1, KV_HEADS, HEAD_DIM)[:context].transpose(0, 1)[None]
        qt = q.transpose(0, 1)[None]
        mask = None
        if prefix:
            positions = torch.arange(prefix, context, device="cuda")
            mask = torch.arange(context, device="cuda")[None, :] <= positions[:, None]

        def sdpa():
            if mask is None:
                return F.scaled_dot_product_attention(qt, k, v, is_causal=True, scale=scale, enable_gqa=True)
            return F.scaled_dot_product_attention(qt, k, v, attn_mask=mask, scale=scale, enable_gqa=True)

        ref = sdpa()[0].transpose(0, 1).float()
        run = lambda: prefill_attention(q, kv[0], kv[1], query_start_loc, seq_lens, page_tables, scale,
                                        max_query_len=chunk)
        error = relative_error(run(), ref)
        if not error < 1e-2:
            raise SystemExit(f"prefill prefix={prefix} chunk={chunk}: error {error}")
        ours, baseline = bench_ms(run), bench_ms(sdpa)
        variants = {}
        for variant in PREFILL_VARIANTS if sweep else []:
            tuned = lambda: prefill_attention(q, kv[0], kv[1], query_start_loc, seq_lens, page_tables, scale,
                                              max_query_len=chunk, **variant)
            try:
                if relative_error(tuned(), ref) < 1e-2:
                    variants["m{block_m}n{block_n}w{num_warps}s{num_stages}".format(**variant)] = bench_ms(tuned)
            except Exception as error:                             # e.g. out of shared memory
                print(f"variant {variant}: {type(error).__name__}", file=sys.stderr)
        # causal work: each query sees prefix + its position in the chunk; 4 flops per (q, k, d)
        pairs = chunk * prefix + chunk * (chunk + 1) / 2
        flops = 4 * pairs * HEADS * HEAD_DIM
        rows.append({"prefix": prefix, "chunk": chunk, "triton_ms": ours, "triton_TFLOPs": flops / ours / 1e9,
                     "sdpa_ms": baseline, "sdpa_TFLOPs": flops / baseline / 1e9, "rel_error": error,
                     "variants_ms": variants,
                     "best_variant": min(variants, key=variants.get) if variants else None})
    return rows


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batches", default="1,8,32,128")
    parser.add_argument("--contexts", default="1024,4096,16384")
    parser.add_argument("--sweep", action="store_true", help="also time other block sizes / warp counts")
    parser.add_argument("--skip-decode", action="store_true")
    parser.add_argument("--fp8-kv", action="store_true",
                        help="decode over an FP8 cache (e4m3 with per-token scales; the torch side reads its "
                             "dequantized bf16 copy)")
    parser.add_argument("--skip-prefill", action="store_true")
    parser.add_argument("--prefill-sweep", action="store_true", help="time prefill tile/warp/stage variants")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)

    import torch
    import triton

    batches = [int(x) for x in args.batches.split(",")]
    contexts = [int(x) for x in args.contexts.split(",")]
    decode = [] if args.skip_decode else decode_cases(batches, contexts, args.sweep, args.fp8_kv)
    print(f"{'B':>4} {'ctx':>6} {'splits':>6} {'triton ms':>9} {'GB/s':>7} {'torch ms':>9} {'x':>6}  best variant")
    for row in decode:
        print(f"{row['batch']:>4} {row['context']:>6} {row['splits']:>6} {row['triton_ms']:>9.4f} "
              f"{row['triton_GBps']:>7.0f} {row['torch_ms']:>9.4f} {row['speedup_vs_torch']:>6.2f}  "
              f"{row['best_variant']} {row['best_ms']:.4f}")
    prefill = [] if args.skip_prefill else prefill_cases([(0, 512), (0, 2048), (0, 8192), (4096, 1024), (16384, 512)],
                                                         args.prefill_sweep)
    print(f"{'prefix':>6} {'chunk':>6} {'triton ms':>9} {'TFLOP/s':>8} {'sdpa ms':>8} {'TFLOP/s':>8}  best variant")
    for row in prefill:
        best = f"{row['best_variant']} {row['variants_ms'][row['best_variant']]:.3f}" if row["best_variant"] else ""
        print(f"{row['prefix']:>6} {row['chunk']:>6} {row['triton_ms']:>9.3f} {row['triton_TFLOPs']:>8.1f} "
              f"{row['sdpa_ms']:>8.3f} {row['sdpa_TFLOPs']:>8.1f}  {best}")
    document = {"benchmark": "attention kernels", "device": torch.cuda.get_device_name(),
                "torch": torch.__version__, "triton": triton.__version__,
                "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "page_size": PAGE},
                "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "fp8_kv": args.fp8_kv,
                "decode": decode, "prefill": prefill}
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(document, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
