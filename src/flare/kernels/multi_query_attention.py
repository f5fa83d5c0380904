"""Multi-query decode attention: a few new tokens per sequence (1 + k, e.g. k draft tokens being verified)
against the whole paged context, every sequence bringing the same number.

The decode kernel's layout, widened: one program per (sequence, KV head, split) holds all the rows that
read that KV head — each new token's query for each query head of the group (Q x GROUP rows, at most
a few dozen) — so every K/V page is read once per split for all of them, where the prefill kernel
would give each query head a 128-row tile of its own and read the pages once per query head, without
splitting the context. Split-K cuts each context into `num_splits` ranges so a small batch still fills
the GPU; the decode kernel's merge (`_decode_reduce_kernel`) combines the partial results by their
log-sum-exp, token by token. New token i of a sequence sits at position seq_len - Q + i and sees the
keys up to its own position (causal among the new tokens).

Shapes (B sequences, Q new tokens each, T = B * Q):
    q            [T, Hq, D]                    sequence b's tokens are q[b * Q : (b + 1) * Q]
    k_cache      [num_pages, page_size, Hkv, D]  (layer cache[0]); v_cache likewise (layer cache[1])
    page_tables [B, max_pages] int32
    seq_lens     [B] int32                     context length after this step, the Q new tokens included
    out          [T, Hq, D]                    q's dtype
    k_scale      [num_pages, page_size, Hkv] float32 with an FP8 cache (see flare.kernels.decode_attention)
"""

from __future__ import annotations

import triton
import triton.language as tl

from flare.kernels.decode_attention import LOG2E, _check_inputs, _decode_reduce_kernel, check_kv_scales

MAX_QUERY_TOKENS = 16          # the backend sends uniform steps of up to this many tokens per sequence here


@triton.jit(do_not_specialize=["stride_pt", "stride_mot", "stride_moh", "stride_mlt", "stride_mlh", "num_splits"])
def _multi_query_split_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, page_tables_ptr, seq_lens_ptr, mid_o_ptr, mid_lse_ptr,
    qk_scale_log2,
    stride_qt, stride_qh,
    stride_kp, stride_ks, stride_kh,
    stride_vp, stride_vs, stride_vh,
    stride_sp, stride_ss,
    stride_pt,
    stride_mot, stride_moh, stride_mos,
    stride_mlt, stride_mlh,
    num_splits,
    QUERIES: tl.constexpr, PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, BLOCK_R: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr, FP8_KV: tl.constexpr,
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    seq_len = tl.load(seq_lens_ptr + seq)
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)

    # Row r is new token r // GROUP, query head kv_head * GROUP + r % GROUP.
    rows = tl.arange(0, BLOCK_R)
    row_mask = rows < QUERIES * GROUP
    token = (seq * QUERIES + rows // GROUP).to(tl.int64)
    heads = kv_head * GROUP + rows % GROUP
    positions = seq_len - QUERIES + rows // GROUP
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    io_mask = row_mask[:, None] & dim_mask[None, :]
    q = tl.load(q_ptr + token[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                mask=io_mask, other=0.0)

    m = tl.full([BLOCK_R], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_R], dtype=tl.float32)
    acc = tl.zeros([BLOCK_R, BLOCK_D], dtype=tl.float32)
    for n0 in range(start, end, BLOCK_N):
        tokens = n0 + tl.arange(0, BLOCK_N)
        token_mask = tokens < end
        pages = tl.load(page_tables_ptr + seq * stride_pt + tokens // PAGE_SIZE, mask=token_mask, other=0).to(tl.int64)
        offsets = tokens % PAGE_SIZE
        kv_mask = token_mask[:, None] & dim_mask[None, :]
        k = tl.load(k_ptr + pages[:, None] * stride_kp + offsets[:, None] * stride_ks + kv_head * stride_kh
                    + dims[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + pages[:, None] * stride_vp + offsets[:, None] * stride_vs + kv_head * stride_vh
                    + dims[None, :], mask=kv_mask, other=0.0)
        if FP8_KV:          # keys' scales go into the scores, values are dequantized in registers
            scale_offsets = pages * stride_sp + offsets * stride_ss + kv_head
            k_scale = tl.load(ks_ptr + scale_offsets, mask=token_mask, other=0.0)
            v_scale = tl.load(vs_ptr + scale_offsets, mask=token_mask, other=0.0)
            v = (v.to(tl.float32) * v_scale[:, None]).to(q.dtype)
            scores = tl.dot(q, tl.trans(k.to(q.dtype))) * (k_scale * qk_scale_log2)[None, :]
        else:
            scores = tl.dot(q, tl.trans(k)) * qk_scale_log2        # [BLOCK_R, BLOCK_N], log2 units
        visible = token_mask[None, :] & (tokens[None, :] <= positions[:, None])
        scores = tl.where(visible, scores, float("-inf"))
        # A row may see none of a split's first keys (they lie past its position): keep its maximum at
        # -inf without producing exp2(-inf - -inf).
        m_new = tl.maximum(m, tl.max(scores, axis=1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m - m_safe)
        p = tl.exp2(scores - m_safe[:, None])
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
        m = m_new

    has_keys = l > 0
    o = acc / tl.where(has_keys, l, 1.0)[:, None]
    lse = tl.where(has_keys, m + tl.log2(tl.where(has_keys, l, 1.0)), float("-inf"))
    tl.store(mid_o_ptr + token[:, None] * stride_mot + heads[:, None] * stride_moh + split * stride_mos + dims[None, :],
             o, mask=io_mask)
    tl.store(mid_lse_ptr + token * stride_mlt + heads * stride_mlh + split, lse, mask=row_mask)


def multi_query_attention(q, k_cache, v_cache, page_tables, seq_lens, scale: float, num_splits: int,
                          out=None, *, k_scale=None, v_scale=None, block_n: int | None = None,
                          num_warps: int = 4, num_stages: int | None = None):
    """Attention of Q = T // B new tokens per sequence over its paged context, causal among them;
    returns out [T, Hq, D]. num_splits: as decode attention's (`choose_num_splits`, whose programs these
    are too; fixed for a captured graph); block_n, num_warps and num_stages (None: Triton's default) are
    tuning knobs for benchmarks."""
    import torch

    batch = seq_lens.shape[0]
    if batch == 0 or q.shape[0] % batch:
        raise ValueError(f"q has {q.shape[0]} tokens, not the same number for each of {batch} sequences")
    queries = q.shape[0] // batch
    _check_inputs(q[::queries], k_cache, v_cache, page_tables, seq_lens)
    check_kv_scales(q, k_cache, v_cache, k_scale, v_scale)
    num_tokens, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    group = num_heads // num_kv_heads
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} with a contiguous last dim")
    mid_o = torch.empty(num_tokens, num_heads, num_splits, head_dim, dtype=torch.float32, device=q.device)
    mid_lse = torch.empty(num_tokens, num_heads, num_splits, dtype=torch.float32, device=q.device)

    block_d = triton.next_power_of_2(head_dim)
    on_cpu = q.device.type == "cpu"                  # interpreter: short steps, so small tests cross several
    block_n = block_n or (16 if on_cpu else 64)
    launch = {} if on_cpu else {"num_warps": num_warps, **({"num_stages": num_stages} if num_stages else {})}
    fp8 = k_scale is not None
    _multi_query_split_kernel[(batch, num_kv_heads, num_splits)](
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
        QUERIES=queries, PAGE_SIZE=page_size, GROUP=group,
        BLOCK_R=max(16, triton.next_power_of_2(queries * group)),       # tl.dot needs at least 16 rows
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=block_n, FP8_KV=fp8, **launch,
    )
    _decode_reduce_kernel[(num_tokens, num_heads)](
        mid_o, mid_lse, out,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        out.stride(0), out.stride(1),
        num_splits,
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_S=triton.next_power_of_2(num_splits),
    )
    return out


def multi_query_attention_reference(q, k_cache, v_cache, page_tables, seq_lens, scale: float, k_scale=None,
                                    v_scale=None):
    """The same function in plain torch: prefill attention's reference with Q tokens per sequence."""
    import torch

    from flare.kernels.prefill_attention import prefill_attention_reference

    batch = seq_lens.shape[0]
    queries = q.shape[0] // batch
    query_start_loc = torch.arange(0, (batch + 1) * queries, queries, dtype=torch.int32, device=q.device)
    return prefill_attention_reference(q, k_cache, v_cache, query_start_loc, seq_lens, page_tables, scale,
                                       k_scale=k_scale, v_scale=v_scale)
