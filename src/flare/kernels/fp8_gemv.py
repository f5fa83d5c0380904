"""Decode products with FP8 weights: `y = x @ (W * s).T (+ b)` when x has at most MAX_ROWS rows.

At decode the product is bound by reading W, so FP8 halves it. One pass over the weight bytes: each
program streams rows of W in [BLOCK_N, BLOCK_K] tiles (rows contiguous in K: 16-byte loads), turns the
e4m3 values into floats in registers (exact: e4m3 fits in fp16 and bf16), multiplies by x and applies
the scales in float32. Block scales apply per tile: BLOCK_K divides the scale block's width, so a tile
never straddles two scales; where BLOCK_N also divides the block's height (128x128 blocks) the tile has
one scale, which the fma path folds into the BLOCK_K activations rather than into every weight (a
multiply per weight was the block-scaled GEMV's extra cost: 0.54x of bf16 against per-row's 1.10x on the
H200, 2026-12-02); per-row scales apply once, after the loop. The inner products and the
split-K are flare.kernels.gemv's (fma on CUDA cores for one or two rows, tensor cores beyond; float32
partials summed in a fixed order, by its reduction kernel or, with fused_reduce, by the tile's last
program to finish: flare.kernels.tile_counters).

Shapes:
    x       [..., K]  at most MAX_ROWS rows in all; last dim contiguous; bf16/fp16 (fp32 in tests)
    weight  [N, K]    float8_e4m3fn, last dim contiguous
    scale   [ceil(N/row_block), ceil(K/col_block)] float32; col_block 0: one column (per-row scales)
    bias    [N] or None
    out     [..., N]  x's dtype

The torch reference is flare.kernels.fp8_reference.fp8_linear_reference.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from flare.kernels.gemv import _REDUCE_BLOCK, _split_reduce_kernel, choose_split_k
from flare.kernels.routing import MAX_ROWS
from flare.kernels.tile_counters import tile_counters


@dataclass(frozen=True)
class Fp8GemvConfig:
    """Tile sizes and launch knobs of one launch (powers of two except num_stages/split_k)."""

    block_n: int = 64              # output features per program (rows of W)
    block_k: int = 128             # in-features per step: 128 e4m3 = eight 16-byte loads per row
    split_k: int = 1
    use_dot: bool = False          # tensor cores (rows padded to 16) instead of fma
    num_warps: int = 4
    num_stages: int = 4            # weight tiles in flight per program
    fused_reduce: bool = False     # split-K: the last program of a tile sums the partials (no second kernel)


# One or two rows, from the tile sweep on the H200 (fp8_bench --gemv-sweep, 2026-12-03): 128 x 128 e4m3
# tiles over 8 warps, K split until one wave of programs (132 SMs) and slices of 512 bytes a row, the
# split finished inside the kernel. llama-8b per layer 77.9 us (qkv 12.1, o_proj 8.9, gate_up 36.5, down
# 20.4) against 110 us with the 64-row, 4-warp tiles and a reduce kernel.
FMA_CONFIG = Fp8GemvConfig(block_n=128, block_k=128, use_dot=False, num_warps=8, num_stages=4, fused_reduce=True)
FMA_TARGET_PROGRAMS = 132
FMA_MIN_K_PER_SPLIT = 512


def default_config(rows: int, n: int, k: int) -> Fp8GemvConfig:
    """Before tuning: fma for one or two rows (FMA_CONFIG), tensor cores beyond, 64-row tiles of 128 e4m3
    (8 KiB, half the bf16 kernel's 32 x 256) with K split until the grid fills the GPU twice."""
    if rows <= 2:                      # two rows: half the tile, the same registers per thread
        block_n = FMA_CONFIG.block_n // max(rows, 1)
        split_k = choose_split_k(n, k, block_n, FMA_TARGET_PROGRAMS, FMA_MIN_K_PER_SPLIT)
        return replace(FMA_CONFIG, block_n=block_n, split_k=split_k)
    config = Fp8GemvConfig(block_n=64, use_dot=True)
    return replace(config, split_k=choose_split_k(n, k, config.block_n))


@triton.jit(do_not_specialize=["rows"])     # one compilation serves every row count
def _fp8_gemv_kernel(
    x_ptr, w_ptr, s_ptr, b_ptr, out_ptr, partial_ptr, counter_ptr,
    rows, N, K, k_per_split,
    stride_xm, stride_wn, stride_sn, stride_sk, stride_om, stride_ps, stride_pm,
    ROW_BLOCK: tl.constexpr, COL_BLOCK: tl.constexpr,
    HAS_BIAS: tl.constexpr, WRITE_PARTIAL: tl.constexpr, FUSED_REDUCE: tl.constexpr, EVEN_K: tl.constexpr,
    USE_DOT: tl.constexpr, TILE_SCALE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    tile = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    # Clamped indices keep every load in bounds without a mask; duplicated rows are never stored.
    safe_n = tl.minimum(offs_n, N - 1).to(tl.int64)
    safe_m = tl.minimum(offs_m, rows - 1)
    w_ptrs = w_ptr + safe_n[:, None] * stride_wn + offs_k[None, :]
    x_ptrs = x_ptr + safe_m[:, None] * stride_xm + offs_k[None, :]
    s_ptrs = s_ptr + (safe_n // ROW_BLOCK) * stride_sn
    tile_s_ptr = s_ptr + (tile * BLOCK_N // ROW_BLOCK) * stride_sn     # TILE_SCALE: the tile's one scale row

    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    if USE_DOT:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    elif BLOCK_M == 1:
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    else:
        acc3 = tl.zeros([BLOCK_N, BLOCK_M, BLOCK_K], dtype=tl.float32)
    for k_offset in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs + k_offset)
            x = tl.load(x_ptrs + k_offset)
        else:
            k_mask = (k_offset + offs_k) < k_end
            w = tl.load(w_ptrs + k_offset, mask=k_mask[None, :], other=0.0)
            x = tl.load(x_ptrs + k_offset, mask=k_mask[None, :], other=0.0)
        if TILE_SCALE:                                              # one scale for the whole tile
            s = tl.load(tile_s_ptr + (k_offset // COL_BLOCK) * stride_sk)
        elif COL_BLOCK != 0:                                        # this tile's block scales, per row
            s = tl.load(s_ptrs + (k_offset // COL_BLOCK) * stride_sk)
        if USE_DOT:
            part = tl.dot(w.to(x.dtype), tl.trans(x))
            if TILE_SCALE:
                acc += part * s
            elif COL_BLOCK != 0:
                acc += part * s[:, None]
            else:
                acc += part
        else:
            w32 = w.to(tl.float32)
            x32 = x.to(tl.float32)
            if TILE_SCALE:
                x32 = x32 * s
            elif COL_BLOCK != 0:
                w32 = w32 * s[:, None]
            if BLOCK_M == 1:
                acc2 += w32 * x32
            else:
                acc3 += w32[:, None, :] * x32[None, :, :]
    if not USE_DOT:
        if BLOCK_M == 1:
            acc = tl.sum(acc2, axis=1)[:, None]
        else:
            acc = tl.sum(acc3, axis=2)
    if COL_BLOCK == 0:                                              # per-row scales, once
        acc = acc * tl.load(s_ptrs)[:, None]

    store_mask = (offs_n[:, None] < N) & (offs_m[None, :] < rows)
    partial_ptrs = partial_ptr + offs_m[None, :] * stride_pm + offs_n[:, None]
    if WRITE_PARTIAL:
        tl.store(partial_ptrs + split * stride_ps, acc, mask=store_mask)
    if FUSED_REDUCE:                           # the tile's last program to finish sums all of its partials
        tl.debug_barrier()                     # every thread's partial stored before the count goes up
        splits = tl.num_programs(1)
        if tl.atomic_add(counter_ptr + tile, 1, sem="acq_rel", scope="gpu") == splits - 1:
            acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
            for s in range(0, splits):         # split order: the same sum whichever program came last
                acc += tl.load(partial_ptrs + s * stride_ps, mask=store_mask, other=0.0, cache_modifier=".cg")
            _store_output(acc, b_ptr, out_ptr, safe_n, offs_m, offs_n, stride_om, store_mask, HAS_BIAS)
            tl.atomic_xchg(counter_ptr + tile, 0)            # zero again for the next launch
    elif not WRITE_PARTIAL:
        _store_output(acc, b_ptr, out_ptr, safe_n, offs_m, offs_n, stride_om, store_mask, HAS_BIAS)


@triton.jit
def _store_output(acc, b_ptr, out_ptr, safe_n, offs_m, offs_n, stride_om, store_mask, HAS_BIAS: tl.constexpr):
    """out [rows, N] = acc [BLOCK_N, BLOCK_M] transposed (+ bias), in the output's dtype."""
    if HAS_BIAS:
        acc += tl.load(b_ptr + safe_n).to(tl.float32)[:, None]
    tl.store(out_ptr + offs_m[None, :] * stride_om + offs_n[:, None], acc.to(out_ptr.dtype.element_ty),
             mask=store_mask)


def check_fp8_weight(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, row_block: int, col_block: int,
                     bias: torch.Tensor | None, what: str) -> None:
    """Shapes, dtypes and strides the FP8 products need."""
    n, k = weight.shape
    check_fp8_scales(weight, scale, row_block, col_block, what)
    if x.shape[-1] != k:
        raise ValueError(f"{what}: x has {x.shape[-1]} features but the weight expects {k}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"{what}: bias has shape {list(bias.shape)}, expected [{n}]")


def check_fp8_scales(weight: torch.Tensor, scale: torch.Tensor, row_block: int, col_block: int, what: str) -> None:
    """An e4m3 weight with a contiguous last dimension and the float32 scale grid of its layout."""
    n, k = weight.shape
    if weight.dtype != torch.float8_e4m3fn or weight.stride(-1) != 1:
        raise ValueError(f"{what}: the weight must be float8_e4m3fn with a contiguous last dimension")
    grid = (-(-n // row_block), 1 if col_block == 0 else -(-k // col_block))
    if scale.dtype != torch.float32 or tuple(scale.shape) != grid:
        raise ValueError(f"{what}: scale must be float32 {list(grid)} for row_block {row_block}, col_block "
                         f"{col_block}; got {scale.dtype} {list(scale.shape)}")
    if col_block and (col_block % 16 or col_block & (col_block - 1)):
        raise ValueError(f"{what}: col_block {col_block} must be a power of two of at least 16")


def fp8_gemv(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, row_block: int, col_block: int,
             bias: torch.Tensor | None = None, config: Fp8GemvConfig | None = None) -> torch.Tensor:
    """x [..., K] (at most MAX_ROWS rows) @ dequantized weight [N, K].T (+ bias) -> [..., N] in x's dtype."""
    check_fp8_weight(x, weight, scale, row_block, col_block, bias, "fp8_gemv")
    n, k = weight.shape
    x2 = x.reshape(-1, k)
    rows = x2.shape[0]
    if rows > MAX_ROWS:
        raise ValueError(f"fp8_gemv: x has {rows} rows; at most {MAX_ROWS} are supported (use fp8_gemm)")
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows > 0 and n > 0:
        _launch(x2 if x2.stride(-1) == 1 else x2.contiguous(), weight, scale, row_block, col_block, bias, out,
                config or default_config(rows, n, k))
    return out.reshape(*x.shape[:-1], n)


def _launch(x, weight, scale, row_block: int, col_block: int, bias, out, config: Fp8GemvConfig) -> None:
    rows, k = x.shape
    n = weight.shape[0]
    use_dot = config.use_dot and x.dtype != torch.float32          # fp32 stays exact (no tf32)
    block_m = triton.next_power_of_2(rows)
    block_m = max(block_m, 16) if use_dot else block_m
    block_k = min(config.block_k, col_block) if col_block else config.block_k
    split_k = max(1, min(config.split_k, triton.cdiv(k, block_k)))
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), block_k) * block_k
    partial = torch.empty((split_k, rows, n), dtype=torch.float32, device=x.device) if split_k > 1 else out
    fused = split_k > 1 and config.fused_reduce
    tiles = triton.cdiv(n, config.block_n)
    counters = tile_counters(x.device, tiles) if fused else scale
    launch = {} if x.device.type == "cpu" else {"num_warps": config.num_warps, "num_stages": config.num_stages}
    _fp8_gemv_kernel[(tiles, split_k)](
        x, weight, scale, bias if bias is not None else scale, out, partial, counters,
        rows, n, k, k_per_split,
        x.stride(0), weight.stride(0), scale.stride(0), scale.stride(1), out.stride(0),
        partial.stride(0) if split_k > 1 else 0, partial.stride(-2),
        ROW_BLOCK=row_block, COL_BLOCK=col_block,
        HAS_BIAS=bias is not None, WRITE_PARTIAL=split_k > 1, FUSED_REDUCE=fused, EVEN_K=k % block_k == 0,
        USE_DOT=use_dot, TILE_SCALE=col_block != 0 and row_block % config.block_n == 0,
        BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=block_k, **launch,
    )
    if split_k > 1 and not fused:
        _split_reduce_kernel[(triton.cdiv(n, _REDUCE_BLOCK), rows)](
            partial, bias if bias is not None else partial, out, n,
            partial.stride(0), partial.stride(1), out.stride(0),
            SPLIT_K=split_k, HAS_BIAS=bias is not None, BLOCK=_REDUCE_BLOCK, num_warps=4,
        )
