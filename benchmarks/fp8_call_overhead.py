#!/usr/bin/env python
"""Host time of one FP8 projection call outside CUDA graphs (eager prompt steps), against bf16 F.linear.

A step that runs eagerly pays each operator's Python and launch cost on the host; when those add up to more
than the kernels take, the GPU waits. For llama-8b's gate_up at ROWS rows this times, per call (mean over
CALLS calls launched back to back, then one synchronize, after a warm-up):

  bf16 F.linear                    the dense product
  torch.ops.flare.fp8_linear       the routed FP8 operator (dispatch + route + W8A8)
  w8a8_linear                      the W8A8 product called directly
  quantize_activations             our Triton pass alone
  scaled_mm (block-wise)           torch.nn.functional.scaled_mm alone, on quantized inputs
  torch._scaled_mm (block scales)  the private operator with the same scales (where it accepts them)

The GPU time of each is far below its host time at these rows when the host is the bound; a call whose
host time is the larger is launch-bound in an eager step.

    python3 benchmarks/fp8_call_overhead.py --output $OUT/fp8_call_overhead.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def host_us(fn, calls: int) -> float:
    import torch

    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    started = time.perf_counter()
    for _ in range(calls):
        fn()
    launched = time.perf_counter() - started
    torch.cuda.synchronize()
    return launched / calls * 1e6


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--calls", type=int, default=200)
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)

    import torch
    import torch.nn.functional as F

    from flare.kernels import fp8_linear  # noqa: F401  (registers torch.ops.flare.fp8_linear)
    from flare.kernels.fp8_reference import quantize_blocks
    from flare.kernels.fp8_w8a8 import GROUP, _padded_block_scales, quantize_activations, w8a8_linear

    n, k = 28672, 4096
    dense = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / 64
    weight, scale = quantize_blocks(dense.float(), (128, 128))
    weight, scale = weight.cuda(), scale.cuda()
    x = torch.randn(args.rows, k, device="cuda", dtype=torch.bfloat16)
    x8, x_scale = quantize_activations(x, GROUP)
    w_scale = _padded_block_scales(scale).t()
    cases = {
        "bf16 F.linear": lambda: F.linear(x, dense),
        "torch.ops.flare.fp8_linear": lambda: torch.ops.flare.fp8_linear(x, weight, scale, None, 128, 128),
        "w8a8_linear": lambda: w8a8_linear(x, weight, scale, 128, 128),
        "quantize_activations": lambda: quantize_activations(x, GROUP),
        "scaled_mm (block-wise)": lambda: F.scaled_mm(x8, weight.t(), x_scale, F.ScalingType.BlockWise1x128, w_scale,
                                                      F.ScalingType.BlockWise128x128, output_dtype=torch.bfloat16),
        "torch._scaled_mm (block scales)": lambda: torch._scaled_mm(x8, weight.t(), scale_a=x_scale, scale_b=w_scale,
                                                                    out_dtype=torch.bfloat16),
    }
    results = {}
    for name, fn in cases.items():
        try:
            results[name] = {"host_us": host_us(fn, args.calls)}
        except Exception as error:                  # a benchmark reports, never crashes
            results[name] = {"failed": f"{type(error).__name__}: {str(error).splitlines()[0]}"[:300]}
        print(f"{name:34} " + (f"{results[name]['host_us']:8.1f} us a call" if "host_us" in results[name]
                               else results[name]["failed"]), flush=True)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps({
            "benchmark": "fp8 call overhead", "device": torch.cuda.get_device_name(), "torch": torch.__version__,
            "rows": args.rows, "shape": [n, k], "calls": args.calls,
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
