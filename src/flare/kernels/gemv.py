"""Skinny matrix products for decode: `y = x @ W.T (+ b)` when x has at most MAX_ROWS rows.

At decode the product is bound by reading W once, so the kernel streams W in wide tiles (rows of W are
contiguous in K: 16-byte loads) with several tiles in flight per program, accumulates in float32 and
writes y in x's dtype. Two inner products, chosen by `GemvConfig.use_dot`:
  * fma: multiply-add on CUDA cores into a [BLOCK_N, BLOCK_M, BLOCK_K] accumulator reduced once at the
    end; no padding, so best for one or two rows.
  * dot: tensor cores on W-tile x x-tile^T, with the rows padded to 16 (the smallest MMA tile); costs
    no extra weight traffic, so it wins once rows make the fma work heavy.
Split-K: when the output tiles alone are too few to fill the GPU (N=4096 with K=14336 gives 128 tiles),
`split_k` programs share a tile, each over one slice of K, and write float32 partials to a workspace
[split_k, rows, N]; a second kernel sums them in a fixed order (deterministic; no atomics, no host sync,
so it is safe inside CUDA-graph capture).

MAX_ROWS is 16: the dot path pads rows to 16 anyway, so rows 9..16 read the same weight bytes as 8,
and decode graphs of up to 16 sequences benefit.

Shapes:
    x       [..., K]  at most MAX_ROWS rows in all; last dim contiguous
    weight  [N, K]    last dim contiguous
    bias    [N] or None
    out     [..., N]  x's dtype

No layer calls it: on the H200 it matches cuBLAS (docs/performance.md, "Decode GEMV"), so the model's
layers use F.linear. It is kept for `benchmarks/gemv_bench.py`, which measures it against cuBLAS.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import triton
import triton.language as tl

from flare.kernels.routing import MAX_ROWS

TARGET_PROGRAMS = 264          # about two waves of programs on a 132-SM GPU
MIN_K_PER_SPLIT = 1024         # a shorter slice of K costs more in partials and launch than it hides
MAX_SPLIT_K = 16
_REDUCE_BLOCK = 1024


@dataclass(frozen=True)
class GemvConfig:
    """Tile sizes and launch knobs of one gemv launch (all powers of two except num_stages/split_k)."""

    block_n: int = 32              # output features per program (rows of W)
    block_k: int = 256             # in-features per loop step; 8 bf16 = one 16-byte load per thread-slice
    split_k: int = 1               # programs per output tile, each over one slice of K
    use_dot: bool = False          # tensor cores (rows padded to 16) instead of fma
    num_warps: int = 4
    num_stages: int = 3            # software-pipelining depth: weight tiles in flight per program


def default_config(rows: int, n: int, k: int) -> GemvConfig:
    """A reasonable config before tuning.

    fma for one or two rows (no padded work), tensor cores beyond. Then split K in powers of two until
    the grid reaches TARGET_PROGRAMS, keeping each slice at least MIN_K_PER_SPLIT long.
    """
    if rows <= 2:
        config = GemvConfig(block_n=32 // max(rows, 1), block_k=256, use_dot=False, num_warps=4, num_stages=3)
    else:
        config = GemvConfig(block_n=64, block_k=128, use_dot=True, num_warps=4, num_stages=4)
    return replace(config, split_k=choose_split_k(n, k, config.block_n))


def choose_split_k(n: int, k: int, block_n: int, target_programs: int = TARGET_PROGRAMS,
                   min_k_per_split: int = MIN_K_PER_SPLIT) -> int:
    """Double the split until the grid reaches target_programs, keeping slices >= min_k_per_split long."""
    tiles = triton.cdiv(n, block_n)
    split_k = 1
    while (tiles * split_k < target_programs and split_k * 2 <= MAX_SPLIT_K
           and k // (split_k * 2) >= min_k_per_split):
        split_k *= 2
    return split_k


@triton.jit
def _fma_block(w, x, acc):
    """acc [BLOCK_N, BLOCK_M, BLOCK_K] += w [BLOCK_N, BLOCK_K] * x [BLOCK_M, BLOCK_K], in float32."""
    return acc + w.to(tl.float32)[:, None, :] * x.to(tl.float32)[None, :, :]


@triton.jit(do_not_specialize=["rows"])     # one compilation serves every row count
def _gemv_kernel(
    x_ptr, w_ptr, b_ptr, out_ptr,
    rows, N, K, k_per_split,
    stride_xm, stride_wn, stride_om, stride_os,
    HAS_BIAS: tl.constexpr, WRITE_PARTIAL: tl.constexpr, EVEN_K: tl.constexpr, USE_DOT: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    tile = tl.program_id(0)
    split = tl.program_id(1)
    offs_n = tile * BLOCK_N + tl.arange(0, BLOCK_N)
    offs_m = tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    # Clamped indices keep every load in bounds without a mask (masks would cost the 16-byte loads);
    # the duplicated rows and columns are never stored.
    safe_n = tl.minimum(offs_n, N - 1).to(tl.int64)
    safe_m = tl.minimum(offs_m, rows - 1)
    w_ptrs = w_ptr + safe_n[:, None] * stride_wn + offs_k[None, :]
    x_ptrs = x_ptr + safe_m[:, None] * stride_xm + offs_k[None, :]

    k_start = split * k_per_split
    k_end = tl.minimum(k_start + k_per_split, K)
    # fma keeps a partial sum per element of the weight tile and reduces over K once, after the loop.
    if USE_DOT:
        acc = tl.zeros([BLOCK_N, BLOCK_M], dtype=tl.float32)
    elif BLOCK_M == 1:
        acc2 = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)     # one row: plain 2-D, no broadcast axis
    else:
        acc3 = tl.zeros([BLOCK_N, BLOCK_M, BLOCK_K], dtype=tl.float32)
    # k_start is a multiple of 16 only because k_per_split is (the launcher makes it a multiple of
    # BLOCK_K and Triton specialises on that); the loop start's divisibility is what lets the loads
    # below be 16 bytes wide.
    for k_offset in range(k_start, k_end, BLOCK_K):
        if EVEN_K:
            w = tl.load(w_ptrs + k_offset)
            x = tl.load(x_ptrs + k_offset)
        else:
            k_mask = (k_offset + offs_k) < k_end
            w = tl.load(w_ptrs + k_offset, mask=k_mask[None, :], other=0.0)
            x = tl.load(x_ptrs + k_offset, mask=k_mask[None, :], other=0.0)
        if USE_DOT:
            acc = tl.dot(w, tl.trans(x.to(w.dtype)), acc)
        elif BLOCK_M == 1:
            acc2 += w.to(tl.float32) * x.to(tl.float32)
        else:
            acc3 = _fma_block(w, x, acc3)
    if not USE_DOT:
        if BLOCK_M == 1:
            acc = tl.sum(acc2, axis=1)[:, None]
        else:
            acc = tl.sum(acc3, axis=2)

    store_mask = (offs_n[:, None] < N) & (offs_m[None, :] < rows)
    if WRITE_PARTIAL:
        out_ptrs = out_ptr + split * stride_os + offs_m[None, :] * stride_om + offs_n[:, None]
        tl.store(out_ptrs, acc, mask=store_mask)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + safe_n).to(tl.float32)[:, None]
        out_ptrs = out_ptr + offs_m[None, :] * stride_om + offs_n[:, None]
        tl.store(out_ptrs, acc.to(out_ptr.dtype.element_ty), mask=store_mask)


@triton.jit
def _split_reduce_kernel(
    partial_ptr, b_ptr, out_ptr, N, stride_ps, stride_pm, stride_om,
    SPLIT_K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr,
):
    """out[m, n] = sum over splits of partial[s, m, n] (+ bias[n]), in a fixed order."""
    row = tl.program_id(1)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < N
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in tl.static_range(SPLIT_K):
        acc += tl.load(partial_ptr + s * stride_ps + row * stride_pm + offs, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_om + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def gemv(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
         config: GemvConfig | None = None) -> torch.Tensor:
    """x [..., K] (at most MAX_ROWS rows) @ weight[N, K].T (+ bias[N]) -> [..., N] in x's dtype."""
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"gemv: x has {x.shape[-1]} features but the weight expects {k}")
    if weight.stride(-1) != 1:
        raise ValueError("gemv: the weight's last dimension must be contiguous")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"gemv: bias has shape {list(bias.shape)}, expected [{n}]")
    x2 = x.reshape(-1, k)
    rows = x2.shape[0]
    if rows > MAX_ROWS:
        raise ValueError(f"gemv: x has {rows} rows; at most {MAX_ROWS} are supported (use F.linear)")
    out = torch.empty((rows, n), dtype=x.dtype, device=x.device)
    if rows > 0 and n > 0:
        _launch(x2 if x2.stride(-1) == 1 else x2.contiguous(), weight, bias, out,
                config or default_config(rows, n, k))
    return out.reshape(*x.shape[:-1], n)


def _launch(x: torch.Tensor, weight: torch.Tensor, bias, out: torch.Tensor, config: GemvConfig) -> None:
    rows, k = x.shape
    n = weight.shape[0]
    use_dot = config.use_dot and weight.dtype != torch.float32    # fp32 stays exact (no tf32)
    block_m = triton.next_power_of_2(rows)
    block_m = max(block_m, 16) if use_dot else block_m     # 16: the smallest MMA tile
    split_k = max(1, min(config.split_k, triton.cdiv(k, config.block_k)))
    k_per_split = triton.cdiv(triton.cdiv(k, split_k), config.block_k) * config.block_k
    partial = torch.empty((split_k, rows, n), dtype=torch.float32, device=x.device) if split_k > 1 else out
    grid = (triton.cdiv(n, config.block_n), split_k)
    _gemv_kernel[grid](
        x, weight, bias if bias is not None else weight, partial,
        rows, n, k, k_per_split,
        x.stride(0), weight.stride(0), partial.stride(-2), partial.stride(0) if split_k > 1 else 0,
        HAS_BIAS=bias is not None, WRITE_PARTIAL=split_k > 1, EVEN_K=k % config.block_k == 0,
        USE_DOT=use_dot, BLOCK_M=block_m, BLOCK_N=config.block_n, BLOCK_K=config.block_k,
        num_warps=config.num_warps, num_stages=config.num_stages,
    )
    if split_k > 1:
        _split_reduce_kernel[(triton.cdiv(n, _REDUCE_BLOCK), rows)](
            partial, bias if bias is not None else partial, out, n,
            partial.stride(0), partial.stride(1), out.stride(0),
            SPLIT_K=split_k, HAS_BIAS=bias is not None, BLOCK=_REDUCE_BLOCK, num_warps=4,
        )


def gemv_reference(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The same product in float32 through torch, cast to x's dtype."""
    out = x.float() @ weight.float().T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)
