"""Paged decode attention: one new query token per sequence against its whole paged context.

Split-K: each sequence's context is cut into `num_splits` ranges processed by separate programs, so a
small batch still fills the GPU; a second kernel merges the partial results by their log-sum-exp.
GQA-aware: one program serves all query heads that share a KV head, so each K/V page is read once per
split rather than once per query head.

Shapes (T = batch, one token each):
    q            [B, Hq, D]                    last dim contiguous
    k_cache      [num_pages, page_size, Hkv, D]  (layer cache[0]); v_cache likewise (layer cache[1])
    page_tables [B, max_pages] int32          page ids of each sequence, in order
    seq_lens     [B] int32                     context length including the new token (0: padding, gives 0)
    out          [B, Hq, D]                    same dtype as q
    k_scale      [num_pages, page_size, Hkv] float32, with an FP8 cache (k_cache/v_cache float8_e4m3fn):
                 each cached vector's scale (flare.engine.attention's FP8 layout); v_scale likewise.
                 Keys are read as e4m3 times scale into the scores, values dequantized per tile.
                 With fp16_math (the default for an FP8 cache) the products run in fp16: e4m3 turns into
                 fp16 exactly in one instruction per two values, where bf16 takes three, and q is loaded
                 already scaled into log2 units. fp16's range (6.5e4) holds any value of a bf16 model's
                 q (after the 0.13 softmax scale) and V; below 6e-5 it keeps more bits than e4m3 has.
"""

from __future__ import annotations

import math

import triton
import triton.language as tl

LOG2E = 1.4426950408889634
TARGET_PROGRAMS = 264          # about two waves of programs on a 132-SM GPU
MAX_SPLITS = 32
MIN_TOKENS_PER_SPLIT = 256     # a split shorter than this costs more in merging than it saves
# Over an FP8 cache: 128 context tokens a step, two stages in flight (kernel_bench --fp8-kv --sweep, H200,
# 2026-12-03: 64 x 1,024 context 75 us against 107 with bf16's 64-token steps; 256 x 1,024 221 against
# 401, where the bf16 cache takes 275).
FP8_BLOCK_N = 128
FP8_NUM_STAGES = 2


@triton.jit
def online_softmax_step(acc, m, l, scores, v):
    """Fold one block of scores (log2 units, -inf where masked) and its values into the running maximum
    m, normaliser l and output accumulator acc; shared by decode and prefill attention."""
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return acc, m_new, l


# The split count, and the strides that follow from it and from the page table's width, vary between
# steps outside the graphs (mixed steps): not specialized, so one compiled variant serves them all.
@triton.jit(do_not_specialize=["stride_pt", "stride_mob", "stride_moh", "stride_mlb", "stride_mlh", "num_splits"])
def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, page_tables_ptr, seq_lens_ptr, mid_o_ptr, mid_lse_ptr,
    qk_scale_log2,
    stride_qb, stride_qh,
    stride_kp, stride_ks, stride_kh,
    stride_vp, stride_vs, stride_vh,
    stride_sp, stride_ss,
    stride_pt,
    stride_mob, stride_moh, stride_mos,
    stride_mlb, stride_mlh,
    num_splits,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, BLOCK_H: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, FP8_KV: tl.constexpr,
    FP16_MATH: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    group = tl.arange(0, BLOCK_H)
    head_mask = group < GROUP
    heads = kv_head * GROUP + group
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM

    q = tl.load(q_ptr + seq * stride_qb + heads[:, None] * stride_qh + dims[None, :],
                mask=head_mask[:, None] & dim_mask[None, :], other=0.0)
    if FP16_MATH:                                               # scores come out in log2 units
        q = (q.to(tl.float32) * qk_scale_log2).to(tl.float16)

    m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        tokens = n0 + tl.arange(0, BLOCK_N)
        token_mask = tokens < end
        pages = tl.load(page_tables_ptr + seq * stride_pt + tokens // PAGE_SIZE,
                        mask=token_mask, other=0).to(tl.int64)
        offsets = tokens % PAGE_SIZE
        kv_mask = token_mask[:, None] & dim_mask[None, :]
        k = tl.load(k_ptr + pages[:, None] * stride_kp + offsets[:, None] * stride_ks
                    + kv_head * stride_kh + dims[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + pages[:, None] * stride_vp + offsets[:, None] * stride_vs
                    + kv_head * stride_vh + dims[None, :], mask=kv_mask, other=0.0)
        if FP8_KV:          # keys' scales go into the scores, values are dequantized in registers
            scale_offsets = pages * stride_sp + offsets * stride_ss + kv_head
            k_scale = tl.load(ks_ptr + scale_offsets, mask=token_mask, other=0.0)
            v_scale = tl.load(vs_ptr + scale_offsets, mask=token_mask, other=0.0)
            if FP16_MATH:
                v = v.to(tl.float16) * v_scale.to(tl.float16)[:, None]
                scores = tl.dot(q, tl.trans(k.to(tl.float16))) * k_scale[None, :]
            else:
                v = (v.to(tl.float32) * v_scale[:, None]).to(q.dtype)
                scores = tl.dot(q, tl.trans(k.to(q.dtype))) * (k_scale * qk_scale_log2)[None, :]
        else:
            scores = tl.dot(q, tl.trans(k)) * qk_scale_log2       # [BLOCK_H, BLOCK_N], log2 units
        scores = tl.where(token_mask[None, :], scores, float("-inf"))
        acc, m, l = online_softmax_step(acc, m, l, scores, v)

    has_tokens = l > 0
    o = acc / tl.where(has_tokens, l, 1.0)[:, None]
    lse = tl.where(has_tokens, m + tl.log2(tl.where(has_tokens, l, 1.0)), float("-inf"))
    tl.store(mid_o_ptr + seq * stride_mob + heads[:, None] * stride_moh + split * stride_mos + dims[None, :],
             o, mask=head_mask[:, None] & dim_mask[None, :])
    tl.store(mid_lse_ptr + seq * stride_mlb + heads * stride_mlh + split, lse, mask=head_mask)


@triton.jit(do_not_specialize=["stride_mob", "stride_moh", "stride_mlb", "stride_mlh", "num_splits"])
def _decode_reduce_kernel(
    mid_o_ptr, mid_lse_ptr, out_ptr,
    stride_mob, stride_moh, stride_mos,
    stride_mlb, stride_mlh,
    stride_ob, stride_oh,
    num_splits,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_S: tl.constexpr,
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, BLOCK_S)
    split_mask = splits < num_splits
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM

    lse = tl.load(mid_lse_ptr + seq * stride_mlb + head * stride_mlh + splits,
                  mask=split_mask, other=float("-inf"))
    top = tl.max(lse, axis=0)
    top = tl.where(top == float("-inf"), 0.0, top)                 # an empty (padding) sequence gives 0
    weights = tl.exp2(lse - top)                                   # empty splits weigh 0
    o = tl.load(mid_o_ptr + seq * stride_mob + head * stride_moh + splits[:, None] * stride_mos
                + dims[None, :], mask=split_mask[:, None] & dim_mask[None, :], other=0.0)
    total = tl.sum(weights, axis=0)
    merged = tl.sum(o * weights[:, None], axis=0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + seq * stride_ob + head * stride_oh + dims, merged.to(out_ptr.dtype.element_ty),
             mask=dim_mask)


def choose_num_splits(batch: int, num_kv_heads: int, max_seq_len: int) -> int:
    """Enough splits to give the GPU about two waves of programs, never splits shorter than
    MIN_TOKENS_PER_SPLIT. Fixed per captured graph: pass the capture's maximum context."""
    by_occupancy = math.ceil(TARGET_PROGRAMS / max(1, batch * num_kv_heads))
    by_length = max(1, max_seq_len // MIN_TOKENS_PER_SPLIT)
    return max(1, min(by_occupancy, by_length, MAX_SPLITS))


def decode_attention(q, k_cache, v_cache, page_tables, seq_lens, scale: float,
                     num_splits: int, out=None, *, k_scale=None, v_scale=None, block_n: int | None = None,
                     num_warps: int = 4, fp16_math: bool = True, num_stages: int | None = None):
    """Attention of one query token per sequence over its paged context; returns out [B, Hq, D].

    num_splits is fixed for a captured graph (choose_num_splits with the capture's longest context);
    k_scale/v_scale come with an FP8 cache; block_n (context tokens per inner step), num_warps,
    num_stages and fp16_math (an FP8 cache's products in fp16 rather than q's dtype) are knobs for
    benchmarks; left out, an FP8 cache takes FP8_BLOCK_N and FP8_NUM_STAGES."""
    import torch

    _check_inputs(q, k_cache, v_cache, page_tables, seq_lens)
    check_kv_scales(q, k_cache, v_cache, k_scale, v_scale)
    batch, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} with a contiguous last dim")
    if batch == 0:
        return out
    mid_o = torch.empty(batch, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)

    block_d = triton.next_power_of_2(head_dim)
    block_h = max(16, triton.next_power_of_2(group))              # tl.dot needs at least 16 rows
    on_cpu = q.device.type == "cpu"           # interpreter: short steps, so small tests cross several
    fp8 = k_scale is not None
    block_n = block_n or (16 if on_cpu else FP8_BLOCK_N if fp8 else 64)
    num_stages = num_stages or (FP8_NUM_STAGES if fp8 else None)
    launch = {} if on_cpu else {"num_warps": num_warps, **({"num_stages": num_stages} if num_stages else {})}
    _decode_split_kernel[(batch, num_kv_heads, num_splits)](
        q, k_cache, v_cache, k_scale if fp8 else q, v_scale if fp8 else q, page_tables, seq_lens, mid_o, mid_lse,
        scale * LOG2E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        k_scale.stride(0) if fp8 else 0, k_scale.stride(1) if fp8 else 0,
        page_tables.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        num_splits,
        PAGE_SIZE=page_size, GROUP=group, BLOCK_H=block_h, HEAD_DIM=head_dim, BLOCK_D=block_d,
        BLOCK_N=block_n, FP8_KV=fp8, FP16_MATH=fp8 and fp16_math, **launch,
    )
    _decode_reduce_kernel[(batch, num_heads)](
        mid_o, mid_lse, out,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        num_splits,
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=triton.next_power_of_2(num_splits),
    )
    return out


def _check_inputs(q, k_cache, v_cache, page_tables, seq_lens) -> None:
    import torch

    if q.dim() != 3:
        raise ValueError(f"q must be [B, Hq, D], got {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k/v caches must both be [pages, page_size, Hkv, D], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    batch, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    if k_cache.shape[3] != head_dim:
        raise ValueError(f"head_dim differs: q {head_dim}, cache {k_cache.shape[3]}")
    if num_heads % num_kv_heads:
        raise ValueError(f"{num_heads} query heads do not divide into {num_kv_heads} KV heads")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("q and the caches need a contiguous head dimension")
    if page_tables.dim() != 2 or page_tables.shape[0] < batch or page_tables.dtype != torch.int32:
        raise ValueError(f"page_tables must be int32 [B, max_pages], got {page_tables.dtype} "
                         f"{tuple(page_tables.shape)}")
    if page_tables.stride(1) != 1:
        raise ValueError("page_tables rows must be contiguous")
    if seq_lens.dim() != 1 or seq_lens.shape[0] < batch or seq_lens.dtype != torch.int32:
        raise ValueError(f"seq_lens must be int32 [B], got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    for name, tensor in (("k_cache", k_cache), ("v_cache", v_cache), ("page_tables", page_tables),
                         ("seq_lens", seq_lens)):
        if tensor.device != q.device:
            raise ValueError(f"{name} is on {tensor.device}, q on {q.device}")


def check_kv_scales(q, k_cache, v_cache, k_scale, v_scale) -> None:
    """An FP8 cache comes with float32 scales [pages, page_size, Hkv]; any other cache has q's dtype."""
    import torch

    if k_scale is None and v_scale is None:
        if q.dtype != k_cache.dtype or q.dtype != v_cache.dtype:
            raise ValueError(f"dtypes differ: q {q.dtype}, k {k_cache.dtype}, v {v_cache.dtype}")
        return
    if k_cache.dtype != torch.float8_e4m3fn or v_cache.dtype != torch.float8_e4m3fn:
        raise ValueError(f"scales come with an FP8 cache; got k {k_cache.dtype}, v {v_cache.dtype}")
    for name, tensor in (("k_scale", k_scale), ("v_scale", v_scale)):
        if tensor is None or tensor.dtype != torch.float32 or tuple(tensor.shape) != tuple(k_cache.shape[:3]) \
                or tensor.stride(-1) != 1 or tensor.device != q.device:
            raise ValueError(f"{name} must be float32 {list(k_cache.shape[:3])} with a contiguous last dim on "
                             f"{q.device}; got {None if tensor is None else (tensor.dtype, list(tensor.shape))}")
    if k_scale.stride() != v_scale.stride():
        raise ValueError("k_scale and v_scale must share their strides")


def gathered_kv(cache, scales, pages, length: int):
    """A sequence's cached vectors [length, Hkv, D] in float32 (times their scales for an FP8 cache)."""
    num_kv_heads, head_dim = cache.shape[2], cache.shape[3]
    values = cache[pages].reshape(-1, num_kv_heads, head_dim)[:length].float()
    if scales is None:
        return values
    return values * scales[pages].reshape(-1, num_kv_heads)[:length, :, None]


def decode_attention_reference(q, k_cache, v_cache, page_tables, seq_lens, scale: float, k_scale=None,
                               v_scale=None):
    """The same function in plain torch (float32 math), one sequence at a time."""
    import torch

    batch, num_heads, head_dim = q.shape
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    for seq in range(batch):
        length = int(seq_lens[seq])
        pages = page_tables[seq, : (length + page_size - 1) // page_size].long()
        k = gathered_kv(k_cache, k_scale, pages, length)
        v = gathered_kv(v_cache, v_scale, pages, length)
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)          # [L, Hq, D]
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
        scores = torch.einsum("hd,lhd->hl", q[seq].float(), k) * scale
        out[seq] = torch.einsum("hl,lhd->hd", scores.softmax(dim=-1), v).to(q.dtype)
    return out
