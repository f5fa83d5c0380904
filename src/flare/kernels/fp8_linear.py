"""`torch.ops.flare.fp8_linear`: the FP8 projection as one custom operator, so torch.compile sees one opaque
call. Decode-sized inputs (at most MAX_ROWS rows) take the GEMV, larger ones the GEMM; both weight-only,
so a token's result does not depend on which step computed it beyond float32 summation order.
Hot path: nothing here but dispatch.
"""

from __future__ import annotations

from typing import Optional

import torch

from flare.kernels.fp8_gemm import fp8_gemm
from flare.kernels.fp8_gemv import fp8_gemv
from flare.kernels.routing import MAX_ROWS


@torch.library.custom_op("flare::fp8_linear", mutates_args=())
def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, bias: Optional[torch.Tensor],
               row_block: int, col_block: int) -> torch.Tensor:
    """x [..., K] @ (weight * scale) [N, K].T (+ bias) -> [..., N] in x's dtype (see flare.kernels.fp8_gemv)."""
    if x.numel() <= MAX_ROWS * x.shape[-1]:
        return fp8_gemv(x, weight, scale, row_block, col_block, bias)
    return fp8_gemm(x, weight, scale, row_block, col_block, bias)


@fp8_linear.register_fake
def _fp8_linear_shape(x, weight, scale, bias, row_block, col_block):
    return x.new_empty((*x.shape[:-1], weight.shape[0]))
