"""Prompt-step products with FP8 weights: `y = x @ (W * s).T (+ b)` for x of any number of rows.

Triton, weight-only: each program computes a [BLOCK_M, BLOCK_N] output tile, loading x's tile in its
dtype and W's tile as e4m3, turning W into x's dtype in registers (exact) for the tensor-core product,
and applying the scales in float32: block scales to each K step's partial product (BLOCK_K divides the
scale block's width), per-row scales once at the end. Activations are not quantized, so prompt and
decode steps compute the same function (flare.kernels.fp8_gemv for decode).

`scaled_mm_linear` is the other candidate, measured by benchmarks/fp8_bench.py and not served:
torch._scaled_mm on e4m3 activations quantized per token (per 1x128 group for block weights), i.e.
W8A8, twice the tensor-core rate but a different accuracy from the weight-only path.

Shapes:
    x       [M, K]  last dim contiguous; bf16/fp16 (fp32 in tests)
    weight  [N, K]  float8_e4m3fn, last dim contiguous
    scale   [ceil(N/row_block), ceil(K/col_block)] float32; col_block 0: per-row scales
    bias    [N] or None
    out     [M, N]  x's dtype

The torch reference is flare.kernels.fp8_reference.fp8_linear_reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from flare.kernels.fp8_gemv import check_fp8_weight
from flare.kernels.fp8_reference import E4M3_MAX


@dataclass(frozen=True)
class Fp8GemmConfig:
    block_m: int = 128
    block_n: int = 128
    block_k: int = 128             # at most the scale block's width (128), which it divides
    group_m: int = 8               # output tiles of one column of W visited together (L2 reuse of W)
    num_warps: int = 8
    num_stages: int = 3


def default_config(m: int, device_type: str) -> Fp8GemmConfig:
    """128x128x128 tiles with 8 warps (a bf16 x tile is 32 KiB, an e4m3 W tile 16 KiB per stage); 64 rows
    for short chunks. Small tiles under the interpreter, which pays per element of a tile."""
    if device_type == "cpu":
        return Fp8GemmConfig(block_m=16, block_n=32, block_k=32, group_m=4)
    if m <= 64:
        return Fp8GemmConfig(block_m=64, num_warps=4, num_stages=4)
    return Fp8GemmConfig()


# M (the step's token count) varies from step to step: not specialized, so serving compiles no new variant.
@triton.jit(do_not_specialize=["M"])
def _fp8_gemm_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_sn, stride_sk, stride_om,
    ROW_BLOCK: tl.constexpr, COL_BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    tiles_m = tl.cdiv(M, BLOCK_M)
    tiles_n = tl.cdiv(N, BLOCK_N)
    per_group = GROUP_M * tiles_n
    first_m = (pid // per_group) * GROUP_M
    group_rows = tl.minimum(tiles_m - first_m, GROUP_M)
    tile_m = first_m + (pid % per_group) % group_rows
    tile_n = (pid % per_group) // group_rows

    offs_m = tile_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tile_n * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_k = tl.arange(0, BLOCK_K)
    safe_m = tl.minimum(offs_m, M - 1).to(tl.int64)
    safe_n = tl.minimum(offs_n, N - 1).to(tl.int64)
    x_ptrs = x_ptr + safe_m[:, None] * stride_xm + offs_k[None, :]
    w_ptrs = w_ptr + safe_n[:, None] * stride_wn + offs_k[None, :]
    s_ptrs = s_ptr + (safe_n // ROW_BLOCK) * stride_sn

    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_offset in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs + k_offset)
            w = tl.load(w_ptrs + k_offset)
        else:
            k_mask = (k_offset + offs_k) < K
            x = tl.load(x_ptrs + k_offset, mask=k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs + k_offset, mask=k_mask[None, :], other=0.0)
        if COL_BLOCK != 0:
            part = tl.dot(x, tl.trans(w.to(x.dtype)))
            acc += part * tl.load(s_ptrs + (k_offset // COL_BLOCK) * stride_sk)[None, :]
        else:
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc)
    if COL_BLOCK == 0:
        acc = acc * tl.load(s_ptrs)[None, :]
    if HAS_BIAS:
        acc += tl.load(b_ptr + safe_n).to(tl.float32)[None, :]
    out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
    tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=(offs_m[:, None] < M) & (offs_n[None, :] < N))


def fp8_gemm(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, row_block: int, col_block: int,
             bias: torch.Tensor | None = None, config: Fp8GemmConfig | None = None) -> torch.Tensor:
    """x [..., K] @ dequantized weight [N, K].T (+ bias) -> [..., N] in x's dtype."""
    check_fp8_weight(x, weight, scale, row_block, col_block, bias, "fp8_gemm")
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    m = x2.shape[0]
    out = torch.empty((m, n), dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.reshape(*x.shape[:-1], n)
    config = config or default_config(m, x.device.type)
    block_k = min(config.block_k, col_block) if col_block else config.block_k
    launch = {} if x.device.type == "cpu" else {"num_warps": config.num_warps, "num_stages": config.num_stages}
    grid = (triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n),)
    _fp8_gemm_kernel[grid](
        x2, weight, scale, bias if bias is not None else scale, out,
        m, n, k,
        x2.stride(0), weight.stride(0), scale.stride(0), scale.stride(1), out.stride(0),
        ROW_BLOCK=row_block, COL_BLOCK=col_block, HAS_BIAS=bias is not None, EVEN_K=k % block_k == 0,
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=block_k, GROUP_M=config.group_m, **launch,
    )
    return out.reshape(*x.shape[:-1], n)


# -- the W8A8 candidate (benchmarks only) ------------------------------------------------------------------

def quantize_activations(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] as e4m3 with float32 scales [M, K // group] (group 0: one per row), each amax / 448."""
    m, k = x.shape
    groups = x.float().reshape(m, -1, group) if group else x.float().reshape(m, 1, k)
    amax = groups.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    quantized = (groups / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).reshape(m, k)
    return quantized, scale.squeeze(-1)


def scaled_mm_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, row_block: int, col_block: int,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """W8A8 through torch._scaled_mm (SM89+; block scales need SM90 and CUDA >= 12.9): per-row weight
    scales with per-token activation scales ("row-wise"), or 128x128 weight blocks with 1x128 activation
    groups ("block-wise", N and K multiples of 128). Raises where this torch build does not support it."""
    m, k = x.shape
    n = weight.shape[0]
    if col_block == 0:
        x8, x_scale = quantize_activations(x, 0)
        w_scale = scale.repeat_interleave(row_block, 0)[:n].reshape(1, n)
        return torch._scaled_mm(x8, weight.t(), scale_a=x_scale.reshape(m, 1), scale_b=w_scale,
                                bias=bias, out_dtype=x.dtype)
    if (row_block, col_block) != (128, 128) or n % 128 or k % 128:
        raise ValueError(f"block-wise _scaled_mm needs 128x128 weight blocks and N, K multiples of 128; got "
                         f"{row_block}x{col_block} blocks, N {n}, K {k}")
    x8, x_scale = quantize_activations(x, 128)
    x_scale = x_scale.t().contiguous().t()                         # outer-dim-major, as cuBLAS requires
    from torch.nn.functional import ScalingType, scaled_mm
    out = scaled_mm(x8, weight.t(), x_scale, ScalingType.BlockWise1x128, _padded_block_scales(scale).t(),
                    ScalingType.BlockWise128x128, output_dtype=x.dtype)
    return out if bias is None else out + bias


def _padded_block_scales(scale: torch.Tensor) -> torch.Tensor:
    """cuBLAS wants 128x128 scales [N/128, L4] with K/128 padded up to a multiple of 4 (L4)."""
    pad = -scale.shape[1] % 4
    return torch.nn.functional.pad(scale, (0, pad)) if pad else scale
