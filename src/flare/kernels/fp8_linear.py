"""`torch.ops.flare.fp8_linear`: the FP8 projection as one custom operator, so torch.compile sees one opaque
call. The step's rows choose the kernel (flare.kernels.routing.fp8_route): the GEMV for decode batches of
at most MAX_ROWS, the skinny split-K GEMM below DEQUANTIZE_MIN_ROWS, and from there a one-pass dequantize
into a shared buffer followed by cuBLAS. All three are weight-only (activations stay in x's dtype); the
GEMV and GEMM apply the scales in float32, the dequantize route rounds each scaled weight to x's dtype
once (bf16: at most 2^-9 relative), so a token's result depends on its step's size by float32
summation order and, from DEQUANTIZE_MIN_ROWS, by that rounding.
Hot path: nothing here but dispatch.
"""

from __future__ import annotations

from typing import Optional

import torch

from flare.kernels.fp8_dequantize import dequantize_linear
from flare.kernels.fp8_gemm import fp8_gemm
from flare.kernels.fp8_gemv import fp8_gemv
from flare.kernels.routing import FP8_GEMM, FP8_GEMV, fp8_route


@torch.library.custom_op("flare::fp8_linear", mutates_args=())
def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor],
               row_block: int, col_block: int) -> torch.Tensor:
    """x [..., K] @ (weight * scale) [N, K].T (+ bias) -> [..., N] in x's dtype (see flare.kernels.fp8_gemv)."""
    route = fp8_route(x.numel() // max(x.shape[-1], 1))
    if route == FP8_GEMV:
        return fp8_gemv(x, weight, scale, row_block, col_block, bias)
    if route == FP8_GEMM:
        return fp8_gemm(x, weight, scale, row_block, col_block, bias)
    return dequantize_linear(x, weight, scale, row_block, col_block, bias)


@fp8_linear.register_fake
def _fp8_linear_shape(x, weight, scale, bias, row_block, col_block):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))
