"""Which of the model's matrix products run on our kernels instead of cuBLAS or torch, kept apart from
the kernels so the layers import no Triton: a CPU-only install has none.

Plain (bf16/fp16/fp32) products always take F.linear: our decode GEMV (flare.kernels.gemv) matched
cuBLAS on the H200 (docs/performance.md), so no switch routes them to it.

FP8 projections (flare.models.fp8) have no cuBLAS product to fall back on: on CUDA they always run our
FP8 kernels (flare.kernels.fp8_linear); elsewhere the torch reference, unless `enable_fp8` routes
another device's products through Triton's interpreter (tests). Which FP8 kernel runs depends on the
step's rows (`fp8_route`): decode batches of at most MAX_ROWS take the GEMV (weight-only); from
W8A8_MIN_ROWS the activations are quantized to e4m3 as well, for torch._scaled_mm, where the device and
layout allow. Elsewhere the weight-only routes: up to DEQUANTIZE_MIN_ROWS the skinny split-K GEMM, from
there the weight dequantized to bf16 once, for cuBLAS.
"""

from __future__ import annotations

import torch

MAX_ROWS = 16                  # the GEMV kernels' limit: decode batches of up to 16 sequences
# From this many rows an FP8 product dequantizes its weight (one pass) and runs cuBLAS: the step is
# compute bound, and cuBLAS's tensor-core rate beats the Triton GEMM's by more than moving five bytes
# per weight (e4m3 read, bf16 written and read) instead of one costs. benchmarks/fp8_bench.py compares
# both routes from 32 to 2048 rows. On the H200 (2026-12-02, docs/performance.md) dequantize + cuBLAS won
# at every row count measured, 32 included (all llama-8b/qwen3-8b projections summed: 1,162 vs 1,823 us at
# 32 rows, 1,174 vs 4,527 at 64), so the skinny GEMM serves only 17..31 rows, which were not measured.
DEQUANTIZE_MIN_ROWS = 32
# From this many rows an FP8 product quantizes its activations to e4m3 too and runs torch._scaled_mm
# (W8A8, flare.kernels.fp8_w8a8) where the device supports the layout: one byte read per weight at the
# FP8 tensor-core rate, where the weight-only routes convert or dequantize every weight. Below it the
# GEMV runs, so decode batches of up to MAX_ROWS keep unquantized activations. benchmarks/fp8_bench.py
# times W8A8 against the weight-only routes at every row count it runs: on the H200 (2026-12-03, llama-8b's
# projections, both layouts summed) W8A8 took 255 us at 32 rows against the skinny GEMM's 929 and
# deq+cuBLAS's 617, and 1,633 against 2,754 at 2,048. It starts right after the GEMV's rows rather than
# at the 32 rows measured: a prompt step padded to its graph bucket (16, 32, 64, ...) must take the route
# of the step it stands for, and one switching from weight-only to W8A8 inside a bucket changed the
# export's padded-step check by 0.4 (relative, random weights) and left prompt steps uncaptured.
W8A8_MIN_ROWS = MAX_ROWS + 1

FP8_GEMV, FP8_W8A8 = "gemv", "w8a8"

_fp8_routed_devices: frozenset[str] = frozenset({"cuda"})


def load_fp8_kernels() -> None:
    import flare.kernels.fp8_linear  # noqa: F401  (registers torch.ops.flare.fp8_linear)


def enable_fp8(devices: tuple[str, ...] = ("cuda",)) -> None:
    """Run FP8 products on `devices` through the kernels (cuda always; cpu only makes sense under the
    interpreter)."""
    global _fp8_routed_devices
    load_fp8_kernels()
    _fp8_routed_devices = frozenset(devices) | {"cuda"}


def routes_fp8_to_kernels(x: torch.Tensor) -> bool:
    return x.device.type in _fp8_routed_devices


def fp8_route(rows: int) -> str:
    """The FP8 kernel for a product of `rows` rows: FP8_GEMV, or FP8_W8A8 where the device and layout
    support it and otherwise the weight-only route of those rows (flare.kernels.fp8_linear.weight_only:
    the skinny GEMM below DEQUANTIZE_MIN_ROWS, dequantize + cuBLAS from there)."""
    return FP8_GEMV if rows < W8A8_MIN_ROWS else FP8_W8A8
