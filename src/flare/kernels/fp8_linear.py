"""`torch.ops.flare.fp8_linear`: the FP8 projection as one custom operator, so torch.compile sees one opaque
call. The step's rows choose the kernel (flare.kernels.routing.fp8_route): the GEMV for decode batches of
at most MAX_ROWS, and from W8A8_MIN_ROWS the W8A8 product (activations rounded to e4m3 per group, then
torch._scaled_mm: flare.kernels.fp8_w8a8) where the device and layout support it. Otherwise the
weight-only routes: the skinny split-K GEMM below DEQUANTIZE_MIN_ROWS, from there a one-pass dequantize
into a shared buffer followed by cuBLAS. The weight-only routes keep activations in x's dtype; the GEMV
and GEMM apply the scales in float32, the dequantize route rounds each scaled weight to x's dtype once
(bf16: at most 2^-9 relative). So a token's result depends on its step's size by float32 summation
order, by that rounding, and from W8A8_MIN_ROWS by the activations' rounding to e4m3.
Hot path: nothing here but dispatch.
"""

from __future__ import annotations

from typing import Optional

import torch

from flare.kernels.fp8_dequantize import dequantize_linear
from flare.kernels.fp8_gemm import fp8_gemm
from flare.kernels.fp8_gemv import fp8_gemv
from flare.kernels.fp8_w8a8 import takes_w8a8, w8a8_product
from flare.kernels.routing import DEQUANTIZE_MIN_ROWS, FP8_GEMV, FP8_W8A8, fp8_route


@torch.library.custom_op("flare::fp8_linear", mutates_args=())
def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor],
               row_block: int, col_block: int) -> torch.Tensor:
    """x [..., K] @ (weight * scale) [N, K].T (+ bias) -> [..., N] in x's dtype (see flare.kernels.fp8_gemv)."""
    route = fp8_route(x.numel() // max(x.shape[-1], 1))
    if route == FP8_GEMV:
        return fp8_gemv(x, weight, scale, row_block, col_block, bias)
    if route == FP8_W8A8 and takes_w8a8(x, weight, row_block, col_block):
        return w8a8_product(x, weight, scale, row_block, col_block, bias)
    return weight_only(x, weight, scale, bias, row_block, col_block)


def weight_only(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor],
                row_block: int, col_block: int) -> torch.Tensor:
    """The weight-only product past the GEMV's rows: the skinny GEMM, or dequantize + cuBLAS."""
    if x.numel() // max(x.shape[-1], 1) < DEQUANTIZE_MIN_ROWS:
        return fp8_gemm(x, weight, scale, row_block, col_block, bias)
    return dequantize_linear(x, weight, scale, row_block, col_block, bias)


@fp8_linear.register_fake
def _fp8_linear_shape(x, weight, scale, bias, row_block, col_block):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))
