#!/usr/bin/env python
"""Paged prefill/extend attention on a GPU: the Hopper kernel (flash_prefill) against the previous kernel
(prefill_attention), FlashInfer's FA3 paged kernel (flare.kernels.flashinfer_prefill, where FlashInfer is
installed on a Hopper GPU; its first call JIT-builds it, timed) and SDPA's flash kernel on contiguous K/V,
at llama-8b's attention shape (32 query heads, 8 KV heads, head_dim 128, page size 16, pages shuffled
through the cache), bf16.

One job in one go (about two minutes on an H200):
  1. correctness: both kernels at their default configuration against the float32 torch reference
     (a 1,024-token prompt, a ragged batch with cached prefixes and decode rows, the FP8 cache);
  2. cases: 8,192- and 32,768-token causal prompts and a 1,000-token extend over a 3,000-token cached
     prefix; every configuration of the sweep (tiles, warps, stages) is first checked against SDPA's
     output (a configuration that fails to compile or to match is reported and skipped), then timed
     with CUDA events (median of several runs);
  3. prints a table (ms, TFLOP/s of causal work) and the best configuration per case and overall
     (the geometric mean over the cases), and writes everything as JSON.

    python3 benchmarks/prefill_attention_bench.py --output $OUT/prefill_attention.json
    python3 benchmarks/prefill_attention_bench.py --smoke      # tiny shapes on any device: a script check
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from dataclasses import asdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

HEADS, KV_HEADS, HEAD_DIM, PAGE = 32, 8, 128, 16           # llama-8b / qwen3-8b attention shape
CASES = {"prompt-8k": (0, 8192), "prompt-32k": (0, 32768), "extend-1000-over-3000": (3000, 1000)}
SMOKE_CASES = {"prompt": (0, 48), "extend": (24, 40)}
TOLERANCE = 1e-2                                           # bf16 outputs against a float32 or flash reference


def sweep_configs(smoke: bool) -> list:
    from flare.kernels.flash_prefill import GPU_DEFAULT, FlashConfig

    if smoke:
        return [FlashConfig(16, 16, 4, 1), FlashConfig(32, 16, 4, 1)]
    configs = [FlashConfig(128, n, w, s) for n in (64, 128) for w in (4, 8) for s in (2, 3, 4)]
    configs += [FlashConfig(128, 32, 4, s) for s in (3, 4)]
    configs += [FlashConfig(64, n, 4, s) for n in (32, 64, 128) for s in (2, 3, 4)]
    return [GPU_DEFAULT] + [c for c in configs if c != GPU_DEFAULT]


OLD_VARIANTS = [None, dict(block_m=128, block_n=64, num_warps=8, num_stages=3)]   # None: its default


def timer(device):
    """ms of one call of fn: CUDA events around repeated calls (median), or the host clock on a CPU."""
    import torch

    def cuda_ms(fn, runs=5):
        fn()
        torch.cuda.synchronize()
        samples = []
        for _ in range(runs):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end))
        return statistics.median(samples)

    def host_ms(fn, runs=1):
        fn()
        started = time.perf_counter()
        fn()
        return (time.perf_counter() - started) * 1000

    return cuda_ms if device == "cuda" else host_ms


def paged_case(prefix: int, chunk: int, dtype, device, generator, heads=HEADS, kv_heads=KV_HEADS, dim=HEAD_DIM):
    """One sequence of `chunk` new tokens over `prefix` cached ones, its pages shuffled through the cache."""
    import torch

    context = prefix + chunk
    pages = -(-context // PAGE)
    kv = torch.randn(2, pages + 1, PAGE, kv_heads, dim, generator=generator, device=device).to(dtype)
    order = torch.randperm(pages + 1, generator=generator, device=device)[:pages].int()
    q = torch.randn(chunk, heads, dim, generator=generator, device=device).to(dtype)
    return {"q": q, "kv": kv, "page_tables": order[None].contiguous(),
            "query_start_loc": torch.tensor([0, chunk], dtype=torch.int32, device=device),
            "seq_lens": torch.tensor([context], dtype=torch.int32, device=device),
            "prefix": prefix, "chunk": chunk}


def contiguous_kv(case):
    """K, V [1, Hq, L, D] in position order, each KV head repeated for its query heads (flash takes equal heads)."""
    context = case["prefix"] + case["chunk"]
    group = case["q"].shape[1] // case["kv"].shape[3]
    table = case["page_tables"][0].long()
    k, v = (case["kv"][i][table].flatten(0, 1)[:context] for i in (0, 1))
    return tuple(x.repeat_interleave(group, dim=1).transpose(0, 1)[None].contiguous() for x in (k, v))


def sdpa_flash(case, k, v, scale):
    """SDPA's flash kernel, causal aligned at the bottom right (the chunk's queries are the last positions)."""
    import torch
    import torch.nn.functional as F

    q = case["q"].transpose(0, 1)[None]
    if q.device.type != "cuda":
        positions = torch.arange(case["prefix"], case["prefix"] + case["chunk"], device=q.device)
        mask = torch.arange(k.shape[2], device=q.device)[None, :] <= positions[:, None]
        return lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    return lambda: torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, is_causal=True, scale=scale)[0]


def relative_error(out, ref) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


def causal_flops(prefix: int, chunk: int, heads=HEADS, dim=HEAD_DIM) -> float:
    pairs = chunk * prefix + chunk * (chunk + 1) / 2        # each query sees the prefix and itself and before
    return 4 * pairs * heads * dim


def check_correctness(device, dtype, smoke: bool) -> list:
    """Both kernels at their defaults against the float32 torch reference, bf16 and FP8 caches."""
    import torch

    from flare.engine.attention import fp8_kv_views, quantize_kv
    from flare.kernels.flash_prefill import flash_prefill_attention
    from flare.kernels.prefill_attention import prefill_attention, prefill_attention_reference

    generator = torch.Generator(device=device).manual_seed(7)
    heads, kv_heads, dim = (4, 2, 64) if smoke else (HEADS, KV_HEADS, HEAD_DIM)
    batches = {"prompt": [(0, 40 if smoke else 1024)],
               "ragged": [(0, 37), (16, 1), (100, 1), (61, 200 if not smoke else 20), (3, 5)]}
    rows = []
    for name, sequences in batches.items():
        for fp8 in (False, True):
            pages_per = [-(-(p + c) // PAGE) for p, c in sequences]
            kv = torch.randn(2, sum(pages_per) + 1, PAGE, kv_heads, dim, generator=generator, device=device)
            order = torch.randperm(sum(pages_per) + 1, generator=generator, device=device).int()
            tables = torch.zeros(len(sequences), max(pages_per), dtype=torch.int32, device=device)
            taken = 0
            for i, count in enumerate(pages_per):
                tables[i, :count] = order[taken:taken + count]
                taken += count
            lens = [c for _, c in sequences]
            qsl = torch.tensor([0] + lens, device=device).cumsum(0).int()
            seq_lens = torch.tensor([p + c for p, c in sequences], dtype=torch.int32, device=device)
            q = torch.randn(sum(lens), heads, dim, generator=generator, device=device).to(dtype)
            scales = {}
            if fp8:
                raw = torch.zeros(2, kv.shape[1], PAGE, kv_heads * (dim + 4), dtype=torch.uint8, device=device)
                views = fp8_kv_views(raw, kv_heads, dim)
                for values, scale, part in ((views.k, views.k_scale, kv[0]), (views.v, views.v_scale, kv[1])):
                    quantized, s = quantize_kv(part)
                    values.copy_(quantized)
                    scale.copy_(s)
                caches, ref_caches = (views.k, views.v), (views.k, views.v)
                scales = {"k_scale": views.k_scale, "v_scale": views.v_scale}
            else:
                caches = (kv[0].to(dtype), kv[1].to(dtype))
                ref_caches = (caches[0].float(), caches[1].float())
            args = (qsl, seq_lens, tables, dim ** -0.5)
            ref = prefill_attention_reference(q.float(), *ref_caches, *args, **scales)
            for kernel, fn in (("flash_prefill", flash_prefill_attention), ("prefill_attention", prefill_attention)):
                out = fn(q, *caches, *args, max_query_len=max(lens), **scales)
                error = relative_error(out, ref)
                rows.append({"batch": name, "fp8_kv": fp8, "kernel": kernel, "rel_error": error,
                             "ok": error < TOLERANCE})
    return rows


def bench_case(name, prefix, chunk, dtype, device, configs, measure, generator, smoke: bool) -> dict:
    import torch

    from flare.kernels.flash_prefill import flash_prefill_attention
    from flare.kernels.prefill_attention import prefill_attention

    dims = dict(heads=4, kv_heads=2, dim=64) if smoke else {}
    case = paged_case(prefix, chunk, dtype, device, generator, **dims)
    dim = case["q"].shape[2]
    scale = dim ** -0.5
    k, v = contiguous_kv(case)
    flash = sdpa_flash(case, k, v, scale)
    ref = flash()[0].transpose(0, 1).float()
    flops = causal_flops(prefix, chunk, case["q"].shape[1], dim)
    args = (case["q"], case["kv"][0], case["kv"][1], case["query_start_loc"], case["seq_lens"],
            case["page_tables"], scale)

    def timed(label, fn):
        entry = {"variant": label}
        try:
            error = relative_error(fn(), ref)
            entry["rel_error"] = error
            if error < TOLERANCE:
                entry["ms"] = measure(fn)
                entry["tflops"] = flops / entry["ms"] / 1e9
            else:
                entry["failed"] = f"relative error {error:.2e} over {TOLERANCE}"
        except Exception as exc:                   # out of shared memory, a compile failure, ...
            entry["failed"] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
        return entry

    record = {"case": name, "prefix": prefix, "chunk": chunk, "flops": flops,
              "sdpa_flash": {"ms": measure(flash)}, "flash_prefill": [], "prefill_attention": []}
    record["sdpa_flash"]["tflops"] = flops / record["sdpa_flash"]["ms"] / 1e9
    for config in configs:
        entry = timed(config_label(asdict(config)),
                      lambda c=config: flash_prefill_attention(*args, max_query_len=chunk, config=c))
        entry["config"] = asdict(config)
        record["flash_prefill"].append(entry)
    for variant in OLD_VARIANTS if not smoke else [None]:
        label = "default" if variant is None else config_label(variant)
        record["prefill_attention"].append(
            timed(label, lambda v=variant: prefill_attention(*args, max_query_len=chunk, **(v or {}))))
    record["flashinfer_fa3"] = flashinfer_entry(case, scale, timed)
    for kernel in ("flash_prefill", "prefill_attention"):
        ok = [e for e in record[kernel] if "ms" in e]
        record[f"{kernel}_best"] = min(ok, key=lambda e: e["ms"]) if ok else None
    del case, k, v
    if device == "cuda":
        torch.cuda.empty_cache()
    return record


def flashinfer_entry(case, scale, timed) -> dict | None:
    """FlashInfer's FA3 paged prefill on the case (None where it cannot run); its first call's seconds (the
    JIT build on a machine without it) in `first_call_s`."""
    import torch

    from flare.engine.attention import AttentionMetadata
    from flare.kernels.flashinfer_prefill import FlashInferPrefill, unavailable_reason

    q = case["q"]
    if unavailable_reason(q.device, q.dtype) is not None:
        return None
    context = case["prefix"] + case["chunk"]
    table = case["page_tables"][0, :-(-context // PAGE)].tolist()
    meta = AttentionMetadata.build([case["chunk"]], [context], [table], PAGE, q.device)
    prefill, out = FlashInferPrefill(q.device), torch.empty_like(q)
    started = time.perf_counter()
    try:
        prefill.attend(q, case["kv"][0], case["kv"][1], meta, scale, out)
        torch.cuda.synchronize()
    except Exception as exc:
        return {"variant": "fa3", "failed": f"{type(exc).__name__}: {str(exc)[:300]}"}
    entry = timed("fa3", lambda: prefill.attend(q, case["kv"][0], case["kv"][1], meta, scale, out))
    entry["first_call_s"] = time.perf_counter() - started
    return entry


def config_label(config: dict) -> str:
    return f"m{config['block_m']} n{config['block_n']} w{config['num_warps']} s{config['num_stages']}"


def fastest_variant(records: list, sweep: str) -> tuple[str, list] | None:
    """The variant of each record's `sweep` entries with the smallest geometric mean of time over all
    cases, among those that ran in every case, and its times; None when none did."""
    by_variant: dict[str, list] = {}
    for record in records:
        for entry in record[sweep]:
            by_variant.setdefault(entry["variant"], []).append(entry.get("ms"))
    complete = {v: times for v, times in by_variant.items() if all(t is not None for t in times)}
    if not complete:
        return None
    variant = min(complete, key=lambda v: sum(math.log(t) for t in complete[v]))
    return variant, complete[variant]


def best_overall(records: list) -> dict | None:
    """The flash_prefill configuration with the smallest geometric mean of time over all cases."""
    fastest = fastest_variant(records, "flash_prefill")
    if fastest is None:
        return None
    label, times = fastest
    config = next(e["config"] for e in records[0]["flash_prefill"] if e["variant"] == label)
    return {"variant": label, "config": config, "ms": times}


def print_table(records: list) -> None:
    print(f"\n{'case':24} {'flash_prefill best':28} {'ms':>8} {'TFLOP/s':>8} | {'old ms':>8} {'TFLOP/s':>8} "
          f"| {'sdpa ms':>8} {'TFLOP/s':>8} | {'fa3 ms':>8} {'TFLOP/s':>8}")
    for r in records:
        new, old, sdpa = r["flash_prefill_best"], r["prefill_attention_best"], r["sdpa_flash"]
        default = r["flash_prefill"][0]
        new_text = f"{new['variant']:28} {new['ms']:8.3f} {new['tflops']:8.1f}" if new else f"{'none':28} {'-':>8} {'-':>8}"
        old_text = f"{old['ms']:8.3f} {old['tflops']:8.1f}" if old else f"{'-':>8} {'-':>8}"
        fa3 = r.get("flashinfer_fa3") or {}
        fa3_text = f"{fa3['ms']:8.3f} {fa3['tflops']:8.1f}" if "ms" in fa3 else f"{'-':>8} {fa3.get('failed', '-')[:40]}"
        print(f"{r['case']:24} {new_text} | {old_text} | {sdpa['ms']:8.3f} {sdpa['tflops']:8.1f} | {fa3_text}")
        if "ms" in default:
            print(f"{'':24} default {default['variant']:20} {default['ms']:8.3f} {default['tflops']:8.1f}")
        print_failures(r["flash_prefill"], "configurations")


def bench_device(script: str, smoke: bool):
    """(device, dtype) the kernels run on: bf16 on a GPU; a CPU only for --smoke (float32: the Triton
    interpreter's bf16 products are not trustworthy). None, having said why, otherwise."""
    import torch

    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu" and not smoke:
        print(f"{script} needs a CUDA GPU (or --smoke)", file=sys.stderr)
        return None
    return device, torch.bfloat16 if device == "cuda" else torch.float32


def print_failures(entries: list, what: str) -> None:
    """The entries of a case's sweep that failed to launch, the first three named."""
    failed = [e for e in entries if "failed" in e]
    if failed:
        print(f"{'':24} {len(failed)} of {len(entries)} {what} failed: "
              + "; ".join(f"{e['variant']}: {e['failed'][:60]}" for e in failed[:3]))


def write_document(path: Path | None, benchmark: str, device: str, dtype, correctness: list, records: list,
                   overall: dict | None) -> None:
    """The run as JSON at `path` (nothing without one): device, versions, shape, checks, cases, best."""
    import torch
    import triton

    if path is None:
        return
    document = {"benchmark": benchmark, "device": torch.cuda.get_device_name() if device == "cuda" else "cpu",
                "torch": torch.__version__, "triton": triton.__version__, "dtype": str(dtype),
                "shape": {"heads": HEADS, "kv_heads": KV_HEADS, "head_dim": HEAD_DIM, "page_size": PAGE},
                "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
                "correctness": correctness, "cases": records, "best_overall": overall}
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, indent=1) + "\n")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--cases", default=",".join(CASES), help=f"a subset of {', '.join(CASES)}")
    parser.add_argument("--smoke", action="store_true", help="tiny shapes on whatever device there is")
    parser.add_argument("--output", type=Path, default=None)
    parser.add_argument("--default-only", action="store_true",
                        help="time flash_prefill at its default configuration only (no sweep)")
    args = parser.parse_args(argv)

    import torch

    chosen = bench_device("prefill_attention_bench", args.smoke)
    if chosen is None:
        return 1
    device, dtype = chosen
    began = time.time()
    correctness = check_correctness(device, dtype, args.smoke)
    for row in correctness:
        print(f"correctness {row['batch']:7} fp8_kv={row['fp8_kv']!s:5} {row['kernel']:18} "
              f"rel error {row['rel_error']:.2e} {'ok' if row['ok'] else 'FAILED'}", flush=True)
    measure = timer(device)
    generator = torch.Generator(device=device).manual_seed(1)
    cases = SMOKE_CASES if args.smoke else {name: CASES[name] for name in args.cases.split(",")}
    configs = sweep_configs(args.smoke)[:1] if args.default_only else sweep_configs(args.smoke)
    records = []
    for name, (prefix, chunk) in cases.items():
        records.append(bench_case(name, prefix, chunk, dtype, device, configs, measure, generator, args.smoke))
        print(f"  {name}: done [{time.time() - began:.0f}s]", flush=True)
    print_table(records)
    overall = best_overall(records)
    if overall:
        print(f"\nbest flash_prefill configuration over all cases: {overall['variant']} "
              f"({', '.join(f'{t:.3f}' for t in overall['ms'])} ms)")
    print(f"finished in {time.time() - began:.0f}s")
    write_document(args.output, "paged prefill attention", device, dtype, correctness, records, overall)
    return 0 if all(row["ok"] for row in correctness) else 2


if __name__ == "__main__":
    sys.exit(main())
