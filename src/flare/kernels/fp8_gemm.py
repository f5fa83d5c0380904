"""Products with FP8 weights of more rows than the GEMV takes: `y = x @ (W * s).T (+ b)`, served for
MAX_ROWS < M < DEQUANTIZE_MIN_ROWS (flare.kernels.routing; from there the weight is dequantized for cuBLAS,
flare.kernels.fp8_dequantize).

Triton, weight-only: each program computes a [BLOCK_M, BLOCK_N] output tile over one range of K, loading
x's tile in its dtype and W's tile as e4m3, turning W into x's dtype in registers (exact) for the
tensor-core product, and applying the scales in float32: block scales to each K step's partial product
(BLOCK_K divides the scale block's width), per-row scales once at the end. Activations are not quantized,
so prompt and decode steps compute the same function (flare.kernels.fp8_gemv for decode).

Skinny M is memory bound: the product should cost reading one byte per weight. With the 64x128 tiles of a
long prompt, a 32-row qkv projection (N 6144) had 48 programs on 132 SMs and ran at 0.28x of bf16 cuBLAS
(H200, 2026-12-02). `default_config` therefore picks tiles by (M, N, K) from a small table: BLOCK_M the
smallest of 16/32/64 holding M, narrow BLOCK_N, and a split of K (SPLIT_K programs per output tile) until
the grid has TARGET_PROGRAMS. The split is deterministic: each program writes its float32 partial tile to
a workspace and flare.kernels.gemv's reduction kernel sums the splits in a fixed order (adding the bias),
so a token's result never depends on which program finished first. `candidates` lists the configs
benchmarks/fp8_bench.py sweeps to revise the table.

Shapes:
    x       [M, K]  last dim contiguous; bf16/fp16 (fp32 in tests)
    weight  [N, K]  float8_e4m3fn, last dim contiguous
    scale   [ceil(N/row_block), ceil(K/col_block)] float32; col_block 0: per-row scales
    bias    [N] or None
    out     [M, N]  x's dtype

The torch reference is flare.kernels.fp8_reference.fp8_linear_reference.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from flare.kernels.fp8_gemv import check_fp8_weight
from flare.kernels.gemv import _REDUCE_BLOCK, _split_reduce_kernel
from flare.kernels.routing import DEQUANTIZE_MIN_ROWS

TARGET_PROGRAMS = 264          # two per SM of the H200's 132: enough loads in flight to reach bandwidth
MIN_K_PER_SPLIT = 512          # shorter K ranges spend more on the workspace than they save
MAX_SPLIT_K = 16


@dataclass(frozen=True)
class Fp8GemmConfig:
    block_m: int = 128
    block_n: int = 128
    block_k: int = 128             # at most the scale block's width (128), which it divides
    group_m: int = 8               # output tiles of one column of W visited together (L2 reuse of W)
    split_k: int = 1               # programs per output tile, each over one range of K (float32 partials)
    num_warps: int = 8
    num_stages: int = 3


# Skinny M (up to DEQUANTIZE_MIN_ROWS), by the most rows each serves: a bf16 x tile of 32x128 is 8 KiB,
# an e4m3 W tile of 64x128 8 KiB per stage. split_k comes from choose_split_k.
SKINNY_TABLE: tuple[tuple[int, Fp8GemmConfig], ...] = (
    (16, Fp8GemmConfig(block_m=16, block_n=64, num_warps=4, num_stages=4)),
    (32, Fp8GemmConfig(block_m=32, block_n=64, num_warps=4, num_stages=4)),
    (64, Fp8GemmConfig(block_m=64, block_n=64, num_warps=4, num_stages=4)),
)
LARGE_M = Fp8GemmConfig(block_m=64, block_n=128, num_warps=4, num_stages=4)   # up to DEQUANTIZE_MIN_ROWS
PROMPT = Fp8GemmConfig()                     # more rows (served by dequantize + cuBLAS; benchmarks compare)


def default_config(m: int, n: int, k: int, device_type: str) -> Fp8GemmConfig:
    """The table's tiles for M rows, with K split until the grid fills the GPU. Small tiles under the
    interpreter, which pays per element of a tile."""
    if device_type == "cpu":
        return Fp8GemmConfig(block_m=16, block_n=32, block_k=32, group_m=4)
    config = next((c for rows, c in SKINNY_TABLE if m <= rows), LARGE_M if m < DEQUANTIZE_MIN_ROWS else PROMPT)
    return replace(config, split_k=choose_split_k(m, n, k, config))


def choose_split_k(m: int, n: int, k: int, config: Fp8GemmConfig) -> int:
    """Double the split while the grid is short of TARGET_PROGRAMS and each range keeps MIN_K_PER_SPLIT."""
    tiles = triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n)
    split_k = 1
    while tiles * split_k < TARGET_PROGRAMS and split_k * 2 <= MAX_SPLIT_K and k // (split_k * 2) >= MIN_K_PER_SPLIT:
        split_k *= 2
    return split_k


def candidates(m: int, n: int, k: int) -> tuple[Fp8GemmConfig, ...]:
    """A few configs around the default for M rows (GPU tiles), the default first: narrower and wider
    tiles, half and double the split. What benchmarks/fp8_bench.py sweeps."""
    default = default_config(m, n, k, "cuda")
    narrow = replace(default, block_n=32)
    wide = replace(default, block_n=128, num_warps=8 if default.block_m >= 64 else 4)
    out = [default, replace(narrow, split_k=choose_split_k(m, n, k, narrow)),
           replace(wide, split_k=choose_split_k(m, n, k, wide)),
           replace(default, split_k=max(1, default.split_k // 2)), replace(default, split_k=default.split_k * 2)]
    return tuple(dict.fromkeys(out))


# M (the step's token count) varies from step to step: not specialized, so serving compiles no new variant.
@triton.jit(do_not_specialize=["M", "k_per_split"])
def _fp8_gemm_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, out_ptr,
    M, N, K, k_per_split,
    stride_xm, stride_wn, stride_sn, stride_sk, stride_om, stride_os,
    ROW_BLOCK: tl.constexpr, COL_BLOCK: tl.constexpr, HAS_BIAS: tl.constexpr, EVEN_K: tl.constexpr,
    WRITE_PARTIAL: tl.constexpr, PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    pid = tl.program_id(0)
    split = tl.program_id(1)
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

    # k_per_split is a multiple of BLOCK_K: only the last range's last step reaches past K.
    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k_offset in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs + k_offset)
            w = tl.load(w_ptrs + k_offset)
        else:
            k_mask = (k_offset + offs_k) < K
            x = tl.load(x_ptrs + k_offset, mask=k_mask[None, :], other=0.0)
            w = tl.load(w_ptrs + k_offset, mask=k_mask[None, :], other=0.0)
        if COL_BLOCK != 0:
            part = tl.dot(x, tl.trans(w.to(x.dtype)), input_precision=PRECISION)
            acc += part * tl.load(s_ptrs + (k_offset // COL_BLOCK) * stride_sk)[None, :]
        else:
            acc = tl.dot(x, tl.trans(w.to(x.dtype)), acc, input_precision=PRECISION)
    if COL_BLOCK == 0:
        acc = acc * tl.load(s_ptrs)[None, :]
    store_mask = (offs_m[:, None] < M) & (offs_n[None, :] < N)
    if WRITE_PARTIAL:
        out_ptrs = out_ptr + split * stride_os + offs_m[:, None] * stride_om + offs_n[None, :]
        tl.store(out_ptrs, acc, mask=store_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + safe_n).to(tl.float32)[None, :]
        out_ptrs = out_ptr + offs_m[:, None] * stride_om + offs_n[None, :]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=store_mask)


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
    _launch(x2, weight, scale, row_block, col_block, bias, out, config or default_config(m, n, k, x.device.type))
    return out.reshape(*x.shape[:-1], n)


def _launch(x, weight, scale, row_block: int, col_block: int, bias, out, config: Fp8GemmConfig) -> None:
    m, k = x.shape
    n = weight.shape[0]
    block_k = min(config.block_k, col_block) if col_block else config.block_k
    split_k = max(1, min(config.split_k, triton.cdiv(k, block_k)))
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    split_k = triton.cdiv(k, k_per_split)                           # no empty ranges
    partial = torch.empty((split_k, m, n), dtype=torch.float32, device=x.device) if split_k > 1 else out
    launch = {} if x.device.type == "cpu" else {"num_warps": config.num_warps, "num_stages": config.num_stages}
    grid = (triton.cdiv(m, config.block_m) * triton.cdiv(n, config.block_n), split_k)
    _fp8_gemm_kernel[grid](
        x, weight, scale, bias if bias is not None else scale, partial,
        m, n, k, k_per_split,
        x.stride(0), weight.stride(0), scale.stride(0), scale.stride(1), partial.stride(-2),
        partial.stride(0) if split_k > 1 else 0,
        ROW_BLOCK=row_block, COL_BLOCK=col_block, HAS_BIAS=bias is not None, EVEN_K=k % block_k == 0,
        WRITE_PARTIAL=split_k > 1, PRECISION="ieee" if x.dtype == torch.float32 else None,   # fp32 exact (tests)
        BLOCK_M=config.block_m, BLOCK_N=config.block_n, BLOCK_K=block_k, GROUP_M=config.group_m, **launch,
    )
    if split_k > 1:
        _split_reduce_kernel[(triton.cdiv(n, _REDUCE_BLOCK), m)](
            partial, bias if bias is not None else partial, out, n,
            partial.stride(0), partial.stride(1), out.stride(0),
            SPLIT_K=split_k, HAS_BIAS=bias is not None, BLOCK=_REDUCE_BLOCK, num_warps=4,
        )
