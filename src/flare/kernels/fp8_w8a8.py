"""FP8 products with FP8 activations (W8A8): the activations are quantized to e4m3 as the step runs, then
torch._scaled_mm multiplies e4m3 by e4m3 on the tensor cores (cuBLASLt or CUTLASS, as torch chooses;
block-wise runs cuBLAS's nvjet kernels on the H200).

Why: the weight-only routes either convert every weight in registers (flare.kernels.fp8_gemm, 0.2-0.5x of
bf16 cuBLAS from 32 rows on the H200) or dequantize the whole weight before cuBLAS
(flare.kernels.fp8_dequantize: five bytes moved per weight instead of one). W8A8 reads one byte per
weight and runs at the FP8 tensor-core rate, as vLLM's FP8 linear layers do. The price is accuracy:
each activation is rounded to e4m3 as well (3 mantissa bits) against a float32 scale of its own group,
so from the rows flare.kernels.routing sends here a token's result differs from the weight-only one by
that rounding (benchmarks/fp8_accuracy.py measures both paths).

Activation scales follow the weight's: 128x128 weight blocks take one scale per token and 128 columns
(cuBLAS's 1x128 x 128x128 block-wise mode, SM90 and CUDA 12.9 or later), per-row weight scales one scale
per token (row-wise mode). Each scale is the group's absolute maximum / 448, so nothing saturates; an
all-zero group gets scale 1. The quantization is one Triton pass over x (`quantize_activations`); its
torch reference is flare.kernels.fp8_reference.quantize_activations_reference.

Shapes:
    x       [..., K]  bf16 (the serving dtype; _scaled_mm writes bf16)
    weight  [N, K]    float8_e4m3fn, last dim contiguous
    scale   [N/128, K/128] (block) or [N, 1] (per row) float32
    bias    [N] or None
    out     [..., N]  x's dtype
"""

from __future__ import annotations

import functools

import torch
import triton
import triton.language as tl

from flare.kernels.fp8_gemv import check_fp8_weight
from flare.kernels.fp8_reference import E4M3_MAX

try:                                      # torch's block-wise scaled_mm (2.9+); row-wise needs only _scaled_mm
    from torch.nn.functional import ScalingType, scaled_mm
except ImportError:
    ScalingType = scaled_mm = None

GROUP = 128                    # activation columns per scale with 128x128 weight blocks
GROUPS_PER_PROGRAM = 8         # a program quantizes 8 groups (1,024 values) of one row
ROW_CHUNK = 1024               # per-row scales: values per step of the two passes over a row
# cuBLAS's block-wise mode refused 1 and 33 rows and took 8, 16 and 32 (CUBLAS_STATUS_NOT_SUPPORTED, H200,
# CUDA 13, 2026-12-03). Our reading, not confirmed in cuBLAS's documentation: the activation scales'
# leading dimension (the rows, column-major) must span a multiple of 16 bytes. So the quantized
# activations are padded to a multiple of 4 rows and the output cut back.
BLOCKWISE_ROWS = 4


@triton.jit
def _round_to_e4m3(v):
    """The e4m3 value nearest v (|v| <= 448; ties to even), still in float32, so the cast that follows is
    exact. Adding 1.5 * 2^(23 + s), where 2^s is e4m3's spacing at v (2^-9 below 2^-6, the subnormals),
    rounds v to a multiple of 2^s in float32's own round-to-nearest-even. The GPU's cast would round the
    same way; Triton's interpreter rounds some values into the wrong binade, which this spares the tests."""
    bits = v.to(tl.int32, bitcast=True)
    step = tl.maximum(((bits >> 23) & 0xFF) - 127, -6) - 3
    magic = (((step + 150) << 23) | 0x400000).to(tl.float32, bitcast=True)
    return (v + magic) - magic


@triton.jit
def _quantize_groups_kernel(x_ptr, q_ptr, s_ptr, M, K, stride_xm, stride_qm, stride_sm, stride_sg,
                            GROUP: tl.constexpr, GROUPS: tl.constexpr, E4M3_MAX: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)                          # rows from M on: padding, zero
    groups = tl.program_id(1) * GROUPS + tl.arange(0, GROUPS)
    offs = groups[:, None] * GROUP + tl.arange(0, GROUP)[None, :]
    mask = offs < K                                              # K is a multiple of GROUP
    x = tl.load(x_ptr + row * stride_xm + offs, mask=offs < tl.where(row < M, K, 0), other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.where(amax > 0, tl.math.div_rn(amax, E4M3_MAX), 1.0)
    q = _round_to_e4m3(tl.clamp(tl.math.div_rn(x, scale[:, None]), -E4M3_MAX, E4M3_MAX))
    tl.store(q_ptr + row * stride_qm + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row * stride_sm + groups * stride_sg, scale, mask=groups * GROUP < K)


@triton.jit
def _quantize_rows_kernel(x_ptr, q_ptr, s_ptr, K, stride_xm, stride_qm,
                          CHUNK: tl.constexpr, E4M3_MAX: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, CHUNK)
    amax = tl.zeros([CHUNK], dtype=tl.float32)
    for start in range(0, K, CHUNK):                             # pass 1: the row's absolute maximum
        x = tl.load(x_ptr + row * stride_xm + start + offs, mask=start + offs < K, other=0.0)
        amax = tl.maximum(amax, tl.abs(x.to(tl.float32)))
    top = tl.max(amax, axis=0)
    scale = tl.where(top > 0, tl.math.div_rn(top, E4M3_MAX), 1.0)
    for start in range(0, K, CHUNK):                             # pass 2: the row in e4m3
        mask = start + offs < K
        x = tl.load(x_ptr + row * stride_xm + start + offs, mask=mask, other=0.0).to(tl.float32)
        q = _round_to_e4m3(tl.clamp(tl.math.div_rn(x, scale), -E4M3_MAX, E4M3_MAX))
        tl.store(q_ptr + row * stride_qm + start + offs, q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + row, scale)


def quantize_activations(x: torch.Tensor, group: int, rows: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] (last dim contiguous) as e4m3 and float32 scales: [M, K // group] in column-major order
    (what cuBLAS's block-wise mode reads) for `group` GROUP, [M, 1] for group 0 (one per row). `rows`
    (> M, groups only) pads both to that many rows: zeros with scale 1."""
    m, k = x.shape
    padded = rows or m
    if x.stride(-1) != 1:
        raise ValueError("quantize_activations: x's last dimension must be contiguous")
    quantized = torch.empty((padded, k), dtype=torch.float8_e4m3fn, device=x.device)
    if group == 0:
        if padded != m:
            raise ValueError("quantize_activations: padding is for groups of 128 columns only")
        scale = torch.empty((m, 1), dtype=torch.float32, device=x.device)
        if m:
            _quantize_rows_kernel[(m,)](x, quantized, scale, k, x.stride(0), quantized.stride(0),
                                        CHUNK=ROW_CHUNK, E4M3_MAX=E4M3_MAX)
        return quantized, scale
    if group != GROUP or k % GROUP:
        raise ValueError(f"quantize_activations: groups of {group} over K {k}; only groups of {GROUP} "
                         f"columns with K a multiple of {GROUP} are supported")
    scale = torch.empty((k // GROUP, padded), dtype=torch.float32, device=x.device).t()
    if padded:
        grid = (padded, triton.cdiv(k // GROUP, GROUPS_PER_PROGRAM))
        _quantize_groups_kernel[grid](x, quantized, scale, m, k, x.stride(0), quantized.stride(0), scale.stride(0),
                                      scale.stride(1), GROUP=GROUP, GROUPS=GROUPS_PER_PROGRAM, E4M3_MAX=E4M3_MAX)
    return quantized, scale


@functools.lru_cache(maxsize=None)
def w8a8_supported(n: int, k: int, row_block: int, col_block: int, dtype: torch.dtype, device_index: int) -> bool:
    """Whether this CUDA device and torch build run the product of this layout in W8A8: row-wise needs
    SM89+, block-wise SM90+ with CUDA 12.9+ and torch's block-wise `scaled_mm`; both bf16 output and
    N, K multiples of 16 (block-wise: 128x128 blocks, N and K multiples of 128)."""
    if dtype != torch.bfloat16 or n % 16 or k % 16:
        return False
    capability = torch.cuda.get_device_capability(device_index)
    if (row_block, col_block) == (1, 0):
        return capability >= (8, 9)
    if (row_block, col_block) != (GROUP, GROUP) or n % GROUP or k % GROUP or capability < (9, 0):
        return False
    cuda = tuple(int(part) for part in (torch.version.cuda or "0.0").split(".")[:2])
    return cuda >= (12, 9) and scaled_mm is not None


def w8a8_linear(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, row_block: int, col_block: int,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., K] @ (weight * scale) [N, K].T (+ bias) with x rounded to e4m3 per group first; only for
    layouts `w8a8_supported` accepts (else ValueError)."""
    check_fp8_weight(x, weight, scale, row_block, col_block, bias, "w8a8_linear")
    n, k = weight.shape
    if not takes_w8a8(x, weight, row_block, col_block):
        raise ValueError(f"w8a8_linear: {row_block}x{col_block} scales, N {n}, K {k}, {x.dtype} on {x.device} "
                         "are not supported here")
    return w8a8_product(x, weight, scale, row_block, col_block, bias)


def takes_w8a8(x: torch.Tensor, weight: torch.Tensor, row_block: int, col_block: int) -> bool:
    """Whether `w8a8_product` runs for this activation and weight (`w8a8_supported` on x's CUDA device)."""
    return x.device.type == "cuda" and w8a8_supported(weight.shape[0], weight.shape[1], row_block, col_block,
                                                      x.dtype, x.device.index or 0)


def w8a8_product(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, row_block: int, col_block: int,
                 bias: torch.Tensor | None = None) -> torch.Tensor:
    """`w8a8_linear` without its checks, for a caller that made them (`takes_w8a8`): the routed operator."""
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
    if col_block == 0:
        x8, x_scale = quantize_activations(x2, 0)
        out = torch._scaled_mm(x8, weight.t(), scale_a=x_scale, scale_b=scale.view(1, n), bias=bias,
                               out_dtype=x.dtype)
    else:
        rows = x2.shape[0]
        x8, x_scale = quantize_activations(x2, GROUP, -(-rows // BLOCKWISE_ROWS) * BLOCKWISE_ROWS)
        out = scaled_mm(x8, weight.t(), x_scale, ScalingType.BlockWise1x128, _padded_block_scales(scale).t(),
                        ScalingType.BlockWise128x128, output_dtype=x.dtype)[:rows]
        out = out if bias is None else out + bias
    return out.reshape(*x.shape[:-1], n)


def _padded_block_scales(scale: torch.Tensor) -> torch.Tensor:
    """cuBLAS reads 128x128 scales as [N/128, L4] with K/128 padded up to a multiple of 4 (L4)."""
    pad = -scale.shape[1] % 4
    return torch.nn.functional.pad(scale, (0, pad)) if pad else scale
