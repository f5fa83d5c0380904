"""Prompt-step products with FP8 weights from DEQUANTIZE_MIN_ROWS rows: dequantize the weight, then cuBLAS.

A long prompt step is compute bound: bf16 cuBLAS's tensor-core rate beats our Triton GEMM's (2.8x at
2048 rows on the H200, benchmarks/results/h200_2026-12-02), which outweighs moving five bytes per weight
(e4m3 read, bf16 written and read again) instead of one. The dequantize is one Triton pass: each program
turns a [BLOCK_N, BLOCK_K] tile of e4m3 into x's dtype, multiplying by its scales in float32 exactly as
flare.kernels.fp8_reference.dequantize does, so the result is that function's, rounded once. It writes
into the shared buffer of flare.kernels.fp8_scratch, not a new tensor: one weight-sized allocation per
device, reused by every projection.

Activations are not quantized: the product is the weight-only one of the GEMV and GEMM, except that the
scaled weight is rounded to x's dtype before cuBLAS multiplies (the GEMM keeps the scales in float32).

Shapes:
    weight  [N, K]  float8_e4m3fn, last dim contiguous
    scale   [ceil(N/row_block), ceil(K/col_block)] float32; col_block 0: per-row scales
    out     [N, K]  the dtype asked for (x's), contiguous
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from flare.kernels import fp8_scratch
from flare.kernels.fp8_gemv import check_fp8_scales, check_fp8_weight

BLOCK_N = 32
BLOCK_K = 128                  # at most the scale block's width, which it divides: one scale column per tile


@triton.jit
def _fp8_dequantize_kernel(
    w_ptr, s_ptr, out_ptr, N, K,
    stride_wn, stride_sn, stride_sk, stride_on,
    ROW_BLOCK: tl.constexpr, COL_BLOCK: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    offs_n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    first_k = tl.program_id(1) * BLOCK_K
    offs_k = first_k + tl.arange(0, BLOCK_K)
    rows = offs_n.to(tl.int64)
    mask = (offs_n[:, None] < N) & (offs_k[None, :] < K)
    w = tl.load(w_ptr + rows[:, None] * stride_wn + offs_k[None, :], mask=mask, other=0.0)
    s_ptrs = s_ptr + (tl.minimum(offs_n, N - 1) // ROW_BLOCK) * stride_sn
    if COL_BLOCK != 0:
        s_ptrs += (first_k // COL_BLOCK) * stride_sk
    out = w.to(tl.float32) * tl.load(s_ptrs)[:, None]
    tl.store(out_ptr + rows[:, None] * stride_on + offs_k[None, :], out.to(out_ptr.dtype.element_ty), mask=mask)


def fp8_dequantize(weight: torch.Tensor, scale: torch.Tensor, row_block: int, col_block: int, dtype: torch.dtype,
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """The [N, K] weight in `dtype` (into `out` when given: [N, K], that dtype, contiguous)."""
    check_fp8_scales(weight, scale, row_block, col_block, "fp8_dequantize")
    n, k = weight.shape
    if out is None:
        out = torch.empty((n, k), dtype=dtype, device=weight.device)
    elif out.shape != (n, k) or out.dtype != dtype or not out.is_contiguous():
        raise ValueError(f"fp8_dequantize: out must be contiguous {dtype} [{n}, {k}]; got {out.dtype} "
                         f"{list(out.shape)}")
    if n == 0 or k == 0:
        return out
    block_k = min(BLOCK_K, col_block) if col_block else BLOCK_K
    launch = {} if weight.device.type == "cpu" else {"num_warps": 4}
    _fp8_dequantize_kernel[(triton.cdiv(n, BLOCK_N), triton.cdiv(k, block_k))](
        weight, scale, out, n, k,
        weight.stride(0), scale.stride(0), scale.stride(1), out.stride(0),
        ROW_BLOCK=row_block, COL_BLOCK=col_block, BLOCK_N=BLOCK_N, BLOCK_K=block_k, **launch,
    )
    return out


def dequantize_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, row_block: int, col_block: int,
                      bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ dequantized weight [N, K].T (+ bias) -> [..., N] in x's dtype, through the shared buffer."""
    check_fp8_weight(x, weight, scale, row_block, col_block, bias, "dequantize_linear")
    n, k = weight.shape
    dequantized = fp8_scratch.scratch(weight.device, x.dtype, n, k)
    return F.linear(x, fp8_dequantize(weight, scale, row_block, col_block, x.dtype, dequantized), bias)
