"""Paged decode attention over a latent cache (MLA, absorbed form): one new query token per sequence.

Every query head attends to the same cached rows (flare.engine.mla_attention: `[latent, rotary key]` per
token), so one program serves a block of heads and reads each row once for all of them: scores are
`q_latent . latent + q_rope . rotary key`, the output a softmax-weighted sum of latents. Split-K as
flare.kernels.decode_attention: each sequence's context is cut into `num_splits` ranges, and its reduce
kernel merges the partial results by their log-sum-exp.

Shapes (B sequences, H heads, L = kv_lora_rank, R = qk_rope_head_dim):
    q            [B, H, L + R]                 each head's latent query, then its rotary query
    cache        [num_pages, page_size, L + R] one layer's latent cache (bf16/fp16/fp32), or
                 float8_e4m3fn rows with `scales` [num_pages, page_size, 2] float32 (latent's, rotary's)
    page_tables [B, max_pages] int32
    seq_lens     [B] int32                     context length including the new token (0: padding)
    out          [B, H, L]                     q's dtype
"""

from __future__ import annotations

import triton
import triton.language as tl

from flare.kernels.decode_attention import LOG2E, _decode_reduce_kernel, choose_num_splits

__all__ = ["mla_decode", "mla_decode_reference", "choose_mla_splits"]


@triton.jit
def latent_tile(cache_ptr, scales_ptr, pages, offsets, token_mask, lat, pe,
                stride_cp, stride_cs, stride_sp, stride_ss,
                RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_L: tl.constexpr, BLOCK_P: tl.constexpr,
                FP8: tl.constexpr):
    """The latents [BLOCK_N, BLOCK_L] and rotary keys [BLOCK_N, BLOCK_P] of a tile of cached tokens and,
    for an FP8 cache, their scales [BLOCK_N] each (ones otherwise); masked tokens read as zero."""
    rows = pages * stride_cp + offsets * stride_cs
    k_lat = tl.load(cache_ptr + rows[:, None] + lat[None, :],
                    mask=token_mask[:, None] & (lat < RANK)[None, :], other=0.0)
    k_pe = tl.load(cache_ptr + rows[:, None] + RANK + pe[None, :],
                   mask=token_mask[:, None] & (pe < ROPE)[None, :], other=0.0)
    if FP8:
        scale_rows = pages * stride_sp + offsets * stride_ss
        lat_scale = tl.load(scales_ptr + scale_rows, mask=token_mask, other=0.0)
        pe_scale = tl.load(scales_ptr + scale_rows + 1, mask=token_mask, other=0.0)
    else:
        lat_scale = tl.full([k_lat.shape[0]], 1.0, tl.float32)
        pe_scale = lat_scale
    return k_lat, k_pe, lat_scale, pe_scale


@triton.jit
def latent_scores(q_lat, q_pe, k_lat, k_pe, lat_scale, pe_scale, FP8: tl.constexpr):
    """[rows, BLOCK_N] float32 dot products of the queries with the cached rows."""
    if FP8:
        scores = tl.dot(q_lat, tl.trans(k_lat.to(q_lat.dtype))) * lat_scale[None, :]
        return scores + tl.dot(q_pe, tl.trans(k_pe.to(q_pe.dtype))) * pe_scale[None, :]
    return tl.dot(q_lat, tl.trans(k_lat)) + tl.dot(q_pe, tl.trans(k_pe))


@triton.jit
def latent_softmax_step(acc, m, l, scores, k_lat, lat_scale, FP8: tl.constexpr):
    """Fold one tile of scores (log2 units, -inf where hidden) and its latents into the running maximum,
    normaliser and output; an FP8 tile's latent scale goes into the probabilities."""
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    if FP8:                       # e4m3 turns into fp16 exactly
        acc = acc * alpha[:, None] + tl.dot((p * lat_scale[None, :]).to(tl.float16), k_lat.to(tl.float16))
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(k_lat.dtype), k_lat)
    return acc, m_new, l


@triton.jit(do_not_specialize=["stride_pt", "stride_mob", "stride_moh", "stride_mlb", "stride_mlh", "num_splits"])
def _mla_decode_split_kernel(
    q_ptr, cache_ptr, scales_ptr, page_tables_ptr, seq_lens_ptr, mid_o_ptr, mid_lse_ptr,
    qk_scale_log2,
    stride_qb, stride_qh,
    stride_cp, stride_cs,
    stride_sp, stride_ss,
    stride_pt,
    stride_mob, stride_moh, stride_mos,
    stride_mlb, stride_mlh,
    num_splits,
    NUM_HEADS: tl.constexpr, PAGE_SIZE: tl.constexpr, RANK: tl.constexpr, ROPE: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_N: tl.constexpr,
    FP8: tl.constexpr,
):
    seq = tl.program_id(0)
    head_block = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    heads = head_block * BLOCK_H + tl.arange(0, BLOCK_H)
    head_mask = heads < NUM_HEADS
    lat = tl.arange(0, BLOCK_L)
    pe = tl.arange(0, BLOCK_P)
    q_rows = q_ptr + seq * stride_qb + heads[:, None] * stride_qh
    q_lat = tl.load(q_rows + lat[None, :], mask=head_mask[:, None] & (lat < RANK)[None, :], other=0.0)
    q_pe = tl.load(q_rows + RANK + pe[None, :], mask=head_mask[:, None] & (pe < ROPE)[None, :], other=0.0)
    if FP8:                       # e4m3 turns into fp16 exactly; q scaled into log2 units first
        q_lat = (q_lat.to(tl.float32) * qk_scale_log2).to(tl.float16)
        q_pe = (q_pe.to(tl.float32) * qk_scale_log2).to(tl.float16)

    m = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_H], dtype=tl.float32)
    acc = tl.zeros([BLOCK_H, BLOCK_L], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        tokens = n0 + tl.arange(0, BLOCK_N)
        token_mask = tokens < end
        pages = tl.load(page_tables_ptr + seq * stride_pt + tokens // PAGE_SIZE, mask=token_mask, other=0).to(tl.int64)
        k_lat, k_pe, lat_scale, pe_scale = latent_tile(cache_ptr, scales_ptr, pages, tokens % PAGE_SIZE, token_mask,
                                                       lat, pe, stride_cp, stride_cs, stride_sp, stride_ss,
                                                       RANK, ROPE, BLOCK_L, BLOCK_P, FP8)
        scores = latent_scores(q_lat, q_pe, k_lat, k_pe, lat_scale, pe_scale, FP8)
        if not FP8:
            scores = scores * qk_scale_log2
        scores = tl.where(token_mask[None, :], scores, float("-inf"))
        acc, m, l = latent_softmax_step(acc, m, l, scores, k_lat, lat_scale, FP8)

    has_tokens = l > 0
    o = acc / tl.where(has_tokens, l, 1.0)[:, None]
    lse = tl.where(has_tokens, m + tl.log2(tl.where(has_tokens, l, 1.0)), float("-inf"))
    tl.store(mid_o_ptr + seq * stride_mob + heads[:, None] * stride_moh + split * stride_mos + lat[None, :],
             o, mask=head_mask[:, None] & (lat < RANK)[None, :])
    tl.store(mid_lse_ptr + seq * stride_mlb + heads * stride_mlh + split, lse, mask=head_mask)


def block_heads(num_heads: int) -> int:
    """Heads one program serves: all of them up to 16 (tl.dot's smallest tile), else blocks of 16."""
    return 16 if num_heads >= 16 else max(16, triton.next_power_of_2(num_heads))


def choose_mla_splits(batch: int, num_heads: int, max_seq_len: int) -> int:
    """decode_attention's rule with a program per head block in place of a program per KV head."""
    return choose_num_splits(batch, triton.cdiv(num_heads, block_heads(num_heads)), max_seq_len)


def mla_decode(q, cache, page_tables, seq_lens, scale: float, kv_lora_rank: int, num_splits: int, out=None, *,
               scales=None, block_n: int | None = None, num_warps: int = 4, num_stages: int | None = None):
    """Latent attention of one query token per sequence over its paged context; returns out [B, H, L].

    num_splits is fixed for a captured graph (`choose_mla_splits` with the capture's longest context);
    `scales` come with an FP8 cache; block_n, num_warps and num_stages are knobs for benchmarks."""
    import torch

    check_latent_inputs(q, cache, page_tables, seq_lens, kv_lora_rank, scales)
    batch, num_heads, width = q.shape
    page_size = cache.shape[1]
    if out is None:
        out = q.new_empty(batch, num_heads, kv_lora_rank)
    elif tuple(out.shape) != (batch, num_heads, kv_lora_rank) or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be {[batch, num_heads, kv_lora_rank]} {q.dtype} with a contiguous last dim")
    if batch == 0:
        return out
    mid_o = torch.empty(batch, num_heads, num_splits, kv_lora_rank, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(batch, num_heads, num_splits, dtype=torch.float32, device=q.device)
    on_cpu = q.device.type == "cpu"               # interpreter: short steps, so small tests cross several
    block_h = block_heads(num_heads)
    block_n = block_n or (16 if on_cpu else 32)
    launch = {} if on_cpu else {"num_warps": num_warps, **({"num_stages": num_stages} if num_stages else {})}
    fp8 = scales is not None
    rope = width - kv_lora_rank
    _mla_decode_split_kernel[(batch, triton.cdiv(num_heads, block_h), num_splits)](
        q, cache, scales if fp8 else q, page_tables, seq_lens, mid_o, mid_lse,
        scale * LOG2E,
        q.stride(0), q.stride(1),
        cache.stride(0), cache.stride(1),
        scales.stride(0) if fp8 else 0, scales.stride(1) if fp8 else 0,
        page_tables.stride(0),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        num_splits,
        NUM_HEADS=num_heads, PAGE_SIZE=page_size, RANK=kv_lora_rank, ROPE=rope,
        BLOCK_L=triton.next_power_of_2(kv_lora_rank), BLOCK_P=max(16, triton.next_power_of_2(rope)),
        BLOCK_H=block_h, BLOCK_N=block_n, FP8=fp8, **launch,
    )
    _decode_reduce_kernel[(batch, num_heads)](
        mid_o, mid_lse, out,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        num_splits,
        HEAD_DIM=kv_lora_rank, BLOCK_D=triton.next_power_of_2(kv_lora_rank),
        BLOCK_S=triton.next_power_of_2(num_splits),
    )
    return out


def check_latent_inputs(q, cache, page_tables, seq_lens, kv_lora_rank: int, scales) -> None:
    """Shapes, dtypes, strides and devices the latent kernels need (module docstring)."""
    import torch

    if q.dim() != 3 or cache.dim() != 3 or q.shape[-1] != cache.shape[-1]:
        raise ValueError(f"q [T, H, W] and the cache [pages, page_size, W] must share W; got {tuple(q.shape)} and "
                         f"{tuple(cache.shape)}")
    if not 0 < kv_lora_rank < q.shape[-1]:
        raise ValueError(f"kv_lora_rank {kv_lora_rank} must leave a rotary part of the {q.shape[-1]}-wide rows")
    if q.stride(-1) != 1 or cache.stride(-1) != 1:
        raise ValueError("q and the cache need a contiguous last dimension")
    if scales is None:
        if cache.dtype != q.dtype:
            raise ValueError(f"dtypes differ: q {q.dtype}, cache {cache.dtype}")
    elif (cache.dtype != torch.float8_e4m3fn or scales.dtype != torch.float32
          or tuple(scales.shape) != (*cache.shape[:2], 2) or scales.stride(-1) != 1):
        raise ValueError(f"an FP8 latent cache is float8_e4m3fn with float32 scales {[*cache.shape[:2], 2]}; got "
                         f"{cache.dtype} and {None if scales is None else (scales.dtype, list(scales.shape))}")
    if page_tables.dim() != 2 or page_tables.dtype != torch.int32 or page_tables.stride(1) != 1:
        raise ValueError(f"page_tables must be int32 [B, max_pages] with contiguous rows, got {page_tables.dtype} "
                         f"{tuple(page_tables.shape)}")
    if seq_lens.dim() != 1 or seq_lens.dtype != torch.int32:
        raise ValueError(f"seq_lens must be int32 [B], got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    for name, tensor in (("cache", cache), ("page_tables", page_tables), ("seq_lens", seq_lens)):
        if tensor.device != q.device:
            raise ValueError(f"{name} is on {tensor.device}, q on {q.device}")


def mla_decode_reference(q, cache, page_tables, seq_lens, scale: float, kv_lora_rank: int, scales=None):
    """The same function in plain torch (float32 math), one sequence at a time."""
    from flare.kernels.mla_reference import LatentCacheFp8, gather_latent

    batch, num_heads, _ = q.shape
    view = cache if scales is None else LatentCacheFp8(cache, scales, kv_lora_rank)
    out = q.new_empty(batch, num_heads, kv_lora_rank)
    for seq in range(batch):
        rows = gather_latent(view, page_tables[seq], int(seq_lens[seq])).float()
        probs = (q[seq].float() @ rows.T * scale).softmax(dim=-1)
        out[seq] = (probs @ rows[:, :kv_lora_rank]).to(q.dtype)
    return out
