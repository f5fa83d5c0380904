#!/usr/bin/env python
"""Where a step's GPU time goes: kernel-by-kernel profiles of the engine's real steps, random weights.

Builds the engine at a benchmark shape (random bf16 weights in GPU memory, layers compiled, decode
captured, as `flare run` does), then profiles each case with torch.profiler (CUDA activity):

  prefill-2048    one request's first 2,048-token chunk from an empty cache
  prompt-8192     an 8,192-token prompt through the engine's chunking, to its first token
  prompt-8192x1   the same prompt as one 8,192-token step
  prompt-32768    a 32,768-token prompt through the engine's chunking, to its first token
  mixed-64        64 requests decoding while a 1,000-token prompt arrives (the step that carries it)
  decode-1, decode-64   captured decode steps at batch 1 and 64 (context 1,024); any decode-N is a
                        batch of N

For each case it prints the wall time of the step(s), the summed kernel time, and the kernels grouped
into classes (matmul, attention, elementwise/fused, other) with the top kernels, and writes it all as
JSON (plus gzipped Chrome traces with --traces).

--prompt-graphs captures the piecewise prompt graphs (flare.engine.prompt_graphs) of every token bucket
of the step budget and checks them against the eager step as `ignition export` does; when they pass,
prompt-carrying and mixed steps replay them (the check's note is printed and recorded either way).
Wall time minus kernel time of the prompt cases, with and without, is what they save.

    python benchmarks/profile_step.py llama-8b --output profile.json
    python benchmarks/profile_step.py llama-8b --prompt-graphs --cases prefill-2048,prompt-8192,mixed-64 \
        --output profile-prompt-graphs.json
"""

from __future__ import annotations

import argparse
import gzip
import json
import sys
import time
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from shapes import SHAPES, randomize_  # noqa: E402

CASES = ("prefill-2048", "prompt-8192", "prompt-8192x1", "prompt-32768", "mixed-64", "decode-1", "decode-64")
PROMPT_LENGTHS = {"prefill-2048": 2048, "mixed-64": 1000, "prompt-8192": 8192, "prompt-8192x1": 8192,
                  "prompt-32768": 32768}


def kernel_class(name: str) -> str:
    lowered = name.lower()
    if "splitkreduce" in lowered:                   # cuBLAS's split-K reduction belongs to its product
        return "matmul"
    # Attention first: FlashInfer's FA3 kernel names carry its CUTLASS mainloop.
    if any(key in lowered for key in ("attention", "attn", "flash", "_fwd_kernel", "_prefill_kernel",
                                      "_decode_split_kernel", "_decode_reduce_kernel", "_write_kv_kernel",
                                      "_flash_prefill_kernel", "prefillwithkvcache")):
        return "attention"
    if any(key in lowered for key in ("gemm", "gemv", "sm90_xmma", "cutlass", "matmul", "nvjet", "splitk")):
        return "matmul"
    if lowered.startswith("triton_") or "elementwise" in lowered or "reduce" in lowered:
        return "elementwise/fused"
    if "memcpy" in lowered or "memset" in lowered:
        return "copy"
    return "other"


def summarize(profiler, wall_s: float, steps: int) -> dict:
    kernels: dict[str, list] = {}
    for event in profiler.events():
        on_device = event.device_type.name == "CUDA"
        spent = event.device_time if on_device else event.self_cpu_time_total
        if spent <= 0 or (not on_device and not event.name.startswith("aten::")):
            continue
        entry = kernels.setdefault(event.name, [0.0, 0])
        entry[0] += spent                  # microseconds
        entry[1] += 1
    total_us = sum(us for us, _ in kernels.values())
    classes: dict[str, float] = {}
    for name, (us, _) in kernels.items():
        classes[kernel_class(name)] = classes.get(kernel_class(name), 0.0) + us
    top = sorted(kernels.items(), key=lambda item: -item[1][0])[:14]
    return {"wall_ms": wall_s * 1000, "steps": steps, "kernel_ms": total_us / 1000,
            "classes_ms": {k: v / 1000 for k, v in sorted(classes.items(), key=lambda kv: -kv[1])},
            "top": [{"name": name[:120], "ms": us / 1000, "calls": calls} for name, (us, calls) in top]}


def print_case(name: str, summary: dict) -> None:
    print(f"\n== {name}: wall {summary['wall_ms']:.2f} ms over {summary['steps']} step(s), "
          f"kernels {summary['kernel_ms']:.2f} ms", flush=True)
    print("   " + ", ".join(f"{k} {v:.2f}" for k, v in summary["classes_ms"].items()))
    for row in summary["top"]:
        print(f"   {row['ms']:9.3f} ms {row['calls']:6d}x  {row['name']}")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("shape", choices=sorted(SHAPES))
    parser.add_argument("--layers", type=int, default=None, help="cut the shape to this many layers")
    parser.add_argument("--cases", default=",".join(CASES))
    parser.add_argument("--no-compile", action="store_true")
    parser.add_argument("--prompt-graphs", action="store_true",
                        help="capture and check the prompt graphs; prompt-carrying steps replay them when they pass")
    parser.add_argument("--shrink", action="store_true", help="a small model of the shape's layout (script check)")
    parser.add_argument("--traces", type=Path, default=None, help="folder for gzipped Chrome traces")
    parser.add_argument("--fp8", action="store_true",
                        help="FP8 weights and KV cache, as `ignition export --online-mxfp8 --kv-cache-dtype fp8`")
    parser.add_argument("--prompt-kernel", default="triton", choices=("triton", "flashinfer-fa3"),
                        help="prompt attention: Flare's Triton kernel or FlashInfer's FA3 (Hopper, FlashInfer installed)")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)
    unknown = [case for case in args.cases.split(",") if case not in CASES and not decode_batch(case)]
    if unknown:
        parser.error(f"unknown case(s) {', '.join(unknown)}: choose from {', '.join(CASES)} or decode-N")

    import torch

    from flare.bench import device_identity
    from flare.engine.config import EngineConfig
    from flare.engine.factory import attention_backend
    from flare.engine.runner import ModelRunner
    from flare.models import ModelConfig, build_model
    from flare.models.quantization import DECODER_PROJECTIONS

    shape = dict(SHAPES[args.shape])
    if args.layers:
        shape["num_hidden_layers"] = args.layers
    if args.shrink:                                 # a small model of the same layout, to check the script
        shape.update(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2,
                     head_dim=64, vocab_size=1024)
    precision = {"online_fp8": DECODER_PROJECTIONS, "kv_cache_dtype": "fp8"} if args.fp8 else {}
    cfg = ModelConfig.from_hf_config(shape, **precision)
    device = "cuda" if torch.cuda.is_available() else "cpu"      # the CPU runs only check the script
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    model = build_model(cfg, dtype, device, attention_backend(device, cfg.head_dim))
    randomize_(model)
    page_size, max_len = 16, 32768 + 512
    config = EngineConfig(max_concurrency=72, page_size=page_size, num_pages=80 * (8704 // page_size),
                          prefill_chunk=2048, max_num_batched_tokens=2 * 2048 + 72, max_model_len=max_len,
                          enable_prefix_caching=False)
    started = time.perf_counter()
    if not args.no_compile and device == "cuda":
        from flare.engine.compile import compile_model

        compile_model(model)
    if args.prompt_kernel != "triton":
        from flare.engine.prompt_kernel import use_prompt_kernel

        print(f"prompt kernel: {use_prompt_kernel(model, args.prompt_kernel, device, dtype).detail}", flush=True)
    runner = ModelRunner(model, cfg, config, device, dtype, seed=0, graphs=device == "cuda")
    prompt_graphs = with_prompt_graphs(runner, cfg.fp8 is not None) if args.prompt_graphs else None
    print(f"{args.shape} ({cfg.num_hidden_layers} layers): compile + capture {time.perf_counter() - started:.1f} s",
          flush=True)
    result = {"benchmark": "step profile", "shape": args.shape, "layers": cfg.num_hidden_layers, "fp8": args.fp8,
              "compiled": not args.no_compile, "prompt_graphs": prompt_graphs, "prompt_kernel": args.prompt_kernel, "device": device_identity(),
              "command": " ".join(sys.argv), "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              "cases": {}}
    for case in args.cases.split(","):
        summary = run_case(case, runner, config, cfg.vocab_size, args.traces)
        result["cases"][case] = summary
        print_case(case, summary)
        if args.output:
            args.output.parent.mkdir(parents=True, exist_ok=True)
            args.output.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def decode_batch(case: str) -> int:
    """N for a `decode-N` case, else 0."""
    name, _, batch = case.partition("-")
    return int(batch) if name == "decode" and batch.isdigit() and int(batch) > 0 else 0


def with_prompt_graphs(runner, fp8_projections: bool) -> dict:
    """Capture and check the prompt graphs of the runner's step budget, as export does; the runner replays
    them from here on when they pass. What the check found, for the JSON."""
    from flare.prepare.gpu import check_runner_prompt_graphs
    from flare.engine.config import prompt_graph_sizes

    sizes = prompt_graph_sizes(runner.config.max_num_batched_tokens, fp8_projections)
    check = check_runner_prompt_graphs(runner, sizes)
    print(f"prompt graphs: {len(check.sizes)} buckets, {check.note}", flush=True)
    return {"sizes": list(check.sizes), "note": check.note}


def run_case(case: str, runner, config, vocab_size: int, traces: Path | None) -> dict:
    import dataclasses

    import torch
    from torch.profiler import ProfilerActivity, profile

    from flare.engine.core import EngineCore
    from flare.engine.request import EngineRequest
    from flare.engine.sampling_params import SamplingParams

    generator = torch.Generator().manual_seed(zlib.crc32(case.encode()))
    on_cuda = runner.device.type == "cuda"
    synchronize = torch.cuda.synchronize if on_cuda else (lambda: None)

    def prompt(n):
        return tuple(torch.randint(3, vocab_size, (n,), generator=generator).tolist())

    one_step = dataclasses.replace(config, prefill_chunk=8192, max_num_batched_tokens=8192 + 64)
    core = EngineCore(one_step if case == "prompt-8192x1" else config, runner, eos_token_ids=())
    params = SamplingParams(temperature=0, max_tokens=256, ignore_eos=True)

    def until_first_token(request_id):
        steps = 0
        while core.requests[request_id].num_output_tokens == 0:
            core.step()
            steps += 1
        return steps

    decoding = decode_batch(case) or {"mixed-64": 64}.get(case, 0)
    for i in range(decoding):
        core.add_request(EngineRequest(f"d{i}", prompt(1024), params))
    while any(r.num_computed_tokens < r.num_prompt_tokens for r in core.scheduler.running) or core.scheduler.waiting:
        core.step()
    prompt_case = case in PROMPT_LENGTHS
    length = PROMPT_LENGTHS.get(case, 0)

    def run_once(request_id):
        """The case's step(s); the wall time ends when the GPU is done."""
        if prompt_case:
            core.add_request(EngineRequest(request_id, prompt(length), params))
        synchronize()
        started = time.perf_counter()
        if case.startswith("prompt-"):
            steps = until_first_token(request_id)
        else:
            steps = 1 if prompt_case else 10
            for _ in range(steps):
                core.step()
        synchronize()
        wall = time.perf_counter() - started
        if prompt_case:
            if core.requests[request_id].num_output_tokens == 0:
                raise RuntimeError(f"{case}: the prompt did not reach its first token in {steps} step(s)")
            core.abort([request_id])
        return wall, steps

    run_once("warm")                                 # every kernel and compiled shape of the case once
    wall, steps = run_once("timed")                  # unprofiled wall time
    with profile(activities=[ProfilerActivity.CUDA if on_cuda else ProfilerActivity.CPU]) as profiler:
        run_once("profiled")
    core.abort(list(core.requests))
    if traces is not None:
        traces.mkdir(parents=True, exist_ok=True)
        path = traces / f"{case}.json"
        profiler.export_chrome_trace(str(path))
        with open(path, "rb") as raw, gzip.open(f"{path}.gz", "wb") as packed:
            packed.write(raw.read())
        path.unlink()
    return summarize(profiler, wall, steps)


if __name__ == "__main__":
    sys.exit(main())
