"""Prefill/extend attention over paged KV, and the write of new K/V into the paged cache.

A batch holds several sequences' new tokens, flattened. Each sequence's new K/V are already in the cache
(written by `write_kv` at slot_mapping), after a cached prefix of seq_len - query_len tokens; every new
token attends to the whole prefix and causally to the new tokens up to itself. Decode (one new token)
is the special case query_len == 1, which `decode_attention` serves faster.

Shapes (T = new tokens in the batch, B = sequences):
    q               [T, Hq, D]                      last dim contiguous
    k_cache         [num_pages, page_size, Hkv, D]  (layer cache[0]); v_cache likewise (layer cache[1])
    query_start_loc [B + 1] int32                   sequence b's new tokens are q[qsl[b]:qsl[b+1]]
    seq_lens        [B] int32                       context length after this step
    page_tables    [B, max_pages] int32
    out             [T, Hq, D]                      same dtype as q
    k_scale         [num_pages, page_size, Hkv] float32, with an FP8 cache (float8_e4m3fn k_cache/v_cache,
                    see flare.engine.attention); v_scale likewise. `write_kv_fp8` quantizes new K/V into it.
"""

from __future__ import annotations

import triton
import triton.language as tl

from flare.kernels.decode_attention import check_kv_scales, gathered_kv, online_softmax_step

LOG2E = 1.4426950408889634


@triton.jit
def _attend_keys(acc, m, l, q, positions, k_ptr, v_ptr, ks_ptr, vs_ptr, page_table_ptr, kv_head, start, end,
                 kv_limit, qk_scale_log2, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                 stride_sp, stride_ss,
                 PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_N: tl.constexpr, MASKED: tl.constexpr, DIM_PADDED: tl.constexpr, FP8_KV: tl.constexpr):
    """Online softmax of one query block over keys [start, end); MASKED applies the causal mask and the
    end of the context (kv_limit), which blocks wholly before the queries' own positions do not need."""
    dims = tl.arange(0, BLOCK_D)
    for n0 in range(start, end, BLOCK_N):
        tokens = n0 + tl.arange(0, BLOCK_N)
        if MASKED:
            token_mask = tokens < kv_limit
            pages = tl.load(page_table_ptr + tokens // PAGE_SIZE, mask=token_mask, other=0).to(tl.int64)
        else:
            pages = tl.load(page_table_ptr + tokens // PAGE_SIZE).to(tl.int64)
        offsets = tokens % PAGE_SIZE
        k_ptrs = k_ptr + pages[:, None] * stride_kp + offsets[:, None] * stride_ks + kv_head * stride_kh + dims[None, :]
        v_ptrs = v_ptr + pages[:, None] * stride_vp + offsets[:, None] * stride_vs + kv_head * stride_vh + dims[None, :]
        if MASKED:
            if DIM_PADDED:
                kv_mask = token_mask[:, None] & (dims < HEAD_DIM)[None, :]
            else:
                kv_mask = token_mask[:, None]
            k = tl.load(k_ptrs, mask=kv_mask, other=0.0)
            v = tl.load(v_ptrs, mask=kv_mask, other=0.0)
        elif DIM_PADDED:
            k = tl.load(k_ptrs, mask=(dims < HEAD_DIM)[None, :], other=0.0)
            v = tl.load(v_ptrs, mask=(dims < HEAD_DIM)[None, :], other=0.0)
        else:                                                      # the bulk: no masks, wide loads
            k = tl.load(k_ptrs)
            v = tl.load(v_ptrs)
        if FP8_KV:          # keys' scales go into the scores, values are dequantized in registers
            scale_offsets = pages * stride_sp + offsets * stride_ss + kv_head
            if MASKED:
                k_scale = tl.load(ks_ptr + scale_offsets, mask=token_mask, other=0.0)
                v_scale = tl.load(vs_ptr + scale_offsets, mask=token_mask, other=0.0)
            else:
                k_scale = tl.load(ks_ptr + scale_offsets)
                v_scale = tl.load(vs_ptr + scale_offsets)
            v = (v.to(tl.float32) * v_scale[:, None]).to(q.dtype)
            scores = tl.dot(q, tl.trans(k.to(q.dtype))) * (k_scale * qk_scale_log2)[None, :]
        else:
            scores = tl.dot(q, tl.trans(k)) * qk_scale_log2
        if MASKED:
            visible = (tokens[None, :] <= positions[:, None]) & token_mask[None, :]
            scores = tl.where(visible, scores, float("-inf"))
        acc, m, l = online_softmax_step(acc, m, l, scores, v)
    return acc, m, l


# Integer arguments that vary from step to step are not specialized: every value would otherwise
# compile its own variant (1 and multiples of 16 get one each) in the middle of serving.
@triton.jit(do_not_specialize=["first_seq", "stride_pt"])
def _prefill_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, out_ptr, query_start_loc_ptr, seq_lens_ptr, page_tables_ptr,
    qk_scale_log2, first_seq,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kp, stride_ks, stride_kh,
    stride_vp, stride_vs, stride_vh,
    stride_sp, stride_ss,
    stride_pt,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FP8_KV: tl.constexpr,
):
    seq = first_seq + tl.program_id(0)
    head = tl.program_id(1)
    q_block = tl.num_programs(2) - 1 - tl.program_id(2)           # the longest rows first: a shorter tail
    kv_head = head // GROUP

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_block * BLOCK_M < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        prefix_len = seq_len - q_len
        rows = q_block * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < q_len
        positions = prefix_len + rows                               # absolute position of each query
        dims = tl.arange(0, BLOCK_D)
        io_mask = row_mask[:, None] & (dims < HEAD_DIM)[None, :]
        q = tl.load(q_ptr + (q_start + rows)[:, None].to(tl.int64) * stride_qt + head * stride_qh
                    + dims[None, :], mask=io_mask, other=0.0)

        m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        # Keys before the block's first query position are visible to every row; keys past its last
        # query are visible to none.
        unmasked_end = (prefix_len + q_block * BLOCK_M) // BLOCK_N * BLOCK_N
        kv_end = tl.minimum(seq_len, prefix_len + (q_block + 1) * BLOCK_M)
        page_table_ptr = page_tables_ptr + seq * stride_pt
        acc, m, l = _attend_keys(acc, m, l, q, positions, k_ptr, v_ptr, ks_ptr, vs_ptr, page_table_ptr,
                                 kv_head, 0, unmasked_end, kv_end, qk_scale_log2, stride_kp, stride_ks, stride_kh,
                                 stride_vp, stride_vs, stride_vh, stride_sp, stride_ss, PAGE_SIZE, HEAD_DIM,
                                 BLOCK_D, BLOCK_N, False, HEAD_DIM != BLOCK_D, FP8_KV)
        acc, m, l = _attend_keys(acc, m, l, q, positions, k_ptr, v_ptr, ks_ptr, vs_ptr, page_table_ptr,
                                 kv_head, unmasked_end, kv_end, kv_end, qk_scale_log2, stride_kp, stride_ks,
                                 stride_kh, stride_vp, stride_vs, stride_vh, stride_sp, stride_ss, PAGE_SIZE,
                                 HEAD_DIM, BLOCK_D, BLOCK_N, True, HEAD_DIM != BLOCK_D, FP8_KV)

        o = acc / tl.where(l > 0, l, 1.0)[:, None]
        tl.store(out_ptr + (q_start + rows)[:, None].to(tl.int64) * stride_ot + head * stride_oh
                 + dims[None, :], o.to(out_ptr.dtype.element_ty), mask=io_mask)


@triton.jit
def _write_kv_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kp, stride_ks, stride_kch, stride_vp, stride_vs, stride_vch,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot >= 0:                                                  # -1 marks a padding token
        page = slot // PAGE_SIZE
        offset = slot % PAGE_SIZE
        heads = tl.arange(0, BLOCK_H)
        dims = tl.arange(0, BLOCK_D)
        mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)
        k = tl.load(k_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :], mask=mask)
        v = tl.load(v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :], mask=mask)
        tl.store(k_cache_ptr + page * stride_kp + offset * stride_ks + heads[:, None] * stride_kch
                 + dims[None, :], k, mask=mask)
        tl.store(v_cache_ptr + page * stride_vp + offset * stride_vs + heads[:, None] * stride_vch
                 + dims[None, :], v, mask=mask)


@triton.jit
def _quantize_head_vectors(x_ptr, cache_ptr, scale_ptr, heads, dims, mask, head_mask):
    """Store x [BLOCK_H, BLOCK_D] (one token's heads) as e4m3 of each head's absolute maximum / 448,
    and that scale."""
    x = tl.load(x_ptr, mask=mask, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=1)
    scale = tl.where(amax > 0, amax / 448.0, 1.0)
    quantized = tl.clamp(x / scale[:, None], -448.0, 448.0)
    tl.store(cache_ptr, quantized.to(cache_ptr.dtype.element_ty), mask=mask)
    tl.store(scale_ptr, scale, mask=head_mask)


@triton.jit
def _write_kv_fp8_kernel(
    k_ptr, v_ptr, k_cache_ptr, v_cache_ptr, ks_ptr, vs_ptr, slot_mapping_ptr,
    stride_kt, stride_kh, stride_vt, stride_vh,
    stride_kp, stride_ks, stride_kch, stride_vp, stride_vs, stride_vch, stride_sp, stride_ss,
    NUM_KV_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_D: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot >= 0:                                                  # -1 marks a padding token
        page = slot // PAGE_SIZE
        offset = slot % PAGE_SIZE
        heads = tl.arange(0, BLOCK_H)
        dims = tl.arange(0, BLOCK_D)
        head_mask = heads < NUM_KV_HEADS
        mask = head_mask[:, None] & (dims[None, :] < HEAD_DIM)
        scale_offsets = page * stride_sp + offset * stride_ss + heads
        _quantize_head_vectors(k_ptr + token * stride_kt + heads[:, None] * stride_kh + dims[None, :],
                               k_cache_ptr + page * stride_kp + offset * stride_ks + heads[:, None] * stride_kch
                               + dims[None, :], ks_ptr + scale_offsets, heads, dims, mask, head_mask)
        _quantize_head_vectors(v_ptr + token * stride_vt + heads[:, None] * stride_vh + dims[None, :],
                               v_cache_ptr + page * stride_vp + offset * stride_vs + heads[:, None] * stride_vch
                               + dims[None, :], vs_ptr + scale_offsets, heads, dims, mask, head_mask)


def prefill_attention(q, k_cache, v_cache, query_start_loc, seq_lens, page_tables, scale: float,
                      max_query_len: int, out=None, *, first_seq: int = 0, k_scale=None, v_scale=None,
                      block_m: int | None = None, block_n: int | None = None, num_warps: int | None = None,
                      num_stages: int | None = None):
    """Causal attention of each sequence's new tokens over its paged context; returns out [T, Hq, D].

    `first_seq`: sequences before it are left alone (a mixed step serves them as decodes); their rows
    of `out` are not written. k_scale/v_scale come with an FP8 cache. block_m/block_n (query and key
    tile), num_warps and num_stages are tuning knobs for benchmarks."""
    import torch

    _check_inputs(q, k_cache, v_cache, query_start_loc, seq_lens, page_tables)
    check_kv_scales(q, k_cache, v_cache, k_scale, v_scale)
    num_tokens, num_heads, head_dim = q.shape
    _, page_size, num_kv_heads, _ = k_cache.shape
    batch = seq_lens.shape[0]
    if out is None:
        out = torch.empty_like(q)
    elif out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be {tuple(q.shape)} {q.dtype} with a contiguous last dim")
    if not 0 <= first_seq <= batch:
        raise ValueError(f"first_seq {first_seq} is outside the batch of {batch} sequences")
    if num_tokens == 0 or batch == first_seq:
        return out
    on_cpu = q.device.type == "cpu"                               # small tiles keep the interpreter fast
    # GPU tiles for 2-byte types: the best of a sweep on an H200 (benchmarks/results/prefill_sweep.json),
    # 128 x 128 with 8 warps and 3 stages, for chunks of 512 to 8192 tokens with and without a prefix.
    # float32 (tests only) takes 64 x 64 tiles and 2 stages: the same shared memory in bytes.
    wide = q.element_size() > 2
    if on_cpu:
        tiles, launch = (16, 16), {}
    elif wide:
        tiles, launch = (64, 64), {"num_warps": num_warps or 4, "num_stages": num_stages or 2}
    else:
        tiles, launch = (128, 128), {"num_warps": num_warps or 8, "num_stages": num_stages or 3}
    block_m, block_n = block_m or tiles[0], block_n or tiles[1]
    grid = (batch - first_seq, num_heads, triton.cdiv(max_query_len, block_m))
    fp8 = k_scale is not None
    _prefill_kernel[grid](
        q, k_cache, v_cache, k_scale if fp8 else q, v_scale if fp8 else q, out, query_start_loc, seq_lens,
        page_tables,
        scale * LOG2E, first_seq,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        k_scale.stride(0) if fp8 else 0, k_scale.stride(1) if fp8 else 0,
        page_tables.stride(0),
        PAGE_SIZE=page_size, GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_M=block_m, BLOCK_N=block_n, FP8_KV=fp8, **launch,
    )
    return out


def write_kv(k, v, k_cache, v_cache, slot_mapping) -> None:
    """Store new keys/values k, v [T, Hkv, D] at slot_mapping [T] (int64 page * page_size + offset;
    a negative slot is a padding token and is skipped)."""
    import torch

    if k.shape != v.shape or k.dim() != 3 or k.shape[1:] != k_cache.shape[2:]:
        raise ValueError(f"k/v must be [T, Hkv, D] matching the cache {tuple(k_cache.shape)}, got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    if k_cache.shape != v_cache.shape or k.dtype != k_cache.dtype or v.dtype != v_cache.dtype:
        raise ValueError("k/v caches differ in shape, or their dtype differs from the new k/v")
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"slot_mapping must be int64 [{k.shape[0]}], got {slot_mapping.dtype} "
                         f"{tuple(slot_mapping.shape)}")
    if k.stride(-1) != 1 or v.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k, v and the caches need a contiguous head dimension")
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim), PAGE_SIZE=k_cache.shape[1],
    )


def write_kv_fp8(k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping) -> None:
    """Quantize new keys/values k, v [T, Hkv, D] into an FP8 cache at slot_mapping [T] (negative: padding):
    each head's vector as e4m3 of its absolute maximum / 448, that scale into k_scale/v_scale."""
    import torch

    if k.shape != v.shape or k.dim() != 3 or k.shape[1:] != k_cache.shape[2:]:
        raise ValueError(f"k/v must be [T, Hkv, D] matching the cache {tuple(k_cache.shape)}, got "
                         f"{tuple(k.shape)} and {tuple(v.shape)}")
    check_kv_scales(k, k_cache, v_cache, k_scale, v_scale)
    if slot_mapping.dtype != torch.int64 or slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"slot_mapping must be int64 [{k.shape[0]}], got {slot_mapping.dtype} "
                         f"{tuple(slot_mapping.shape)}")
    if k.stride(-1) != 1 or v.stride(-1) != 1 or k_cache.stride() != v_cache.stride():
        raise ValueError("k and v need a contiguous head dimension, the caches equal strides")
    num_tokens, num_kv_heads, head_dim = k.shape
    if num_tokens == 0:
        return
    _write_kv_fp8_kernel[(num_tokens,)](
        k, v, k_cache, v_cache, k_scale, v_scale, slot_mapping,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), k_scale.stride(0), k_scale.stride(1),
        NUM_KV_HEADS=num_kv_heads, HEAD_DIM=head_dim, BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim), PAGE_SIZE=k_cache.shape[1],
    )


def _check_inputs(q, k_cache, v_cache, query_start_loc, seq_lens, page_tables) -> None:
    import torch

    if q.dim() != 3:
        raise ValueError(f"q must be [T, Hq, D], got {tuple(q.shape)}")
    if k_cache.dim() != 4 or k_cache.shape != v_cache.shape:
        raise ValueError(f"k/v caches must both be [pages, page_size, Hkv, D], got "
                         f"{tuple(k_cache.shape)} and {tuple(v_cache.shape)}")
    num_heads, head_dim = q.shape[1], q.shape[2]
    if k_cache.shape[3] != head_dim or num_heads % k_cache.shape[2]:
        raise ValueError(f"q heads {num_heads} x {head_dim} do not fit cache heads "
                         f"{k_cache.shape[2]} x {k_cache.shape[3]}")
    if q.stride(-1) != 1 or k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("q and the caches need a contiguous head dimension")
    batch = seq_lens.shape[0]
    if seq_lens.dim() != 1 or seq_lens.dtype != torch.int32:
        raise ValueError(f"seq_lens must be int32 [B], got {seq_lens.dtype} {tuple(seq_lens.shape)}")
    if query_start_loc.dtype != torch.int32 or query_start_loc.shape != (batch + 1,):
        raise ValueError(f"query_start_loc must be int32 [{batch + 1}], got {query_start_loc.dtype} "
                         f"{tuple(query_start_loc.shape)}")
    if page_tables.dim() != 2 or page_tables.shape[0] < batch or page_tables.dtype != torch.int32 \
            or page_tables.stride(1) != 1:
        raise ValueError(f"page_tables must be int32 [B, max_pages] with contiguous rows, got "
                         f"{page_tables.dtype} {tuple(page_tables.shape)}")
    for name, tensor in (("k_cache", k_cache), ("v_cache", v_cache), ("query_start_loc", query_start_loc),
                         ("seq_lens", seq_lens), ("page_tables", page_tables)):
        if tensor.device != q.device:
            raise ValueError(f"{name} is on {tensor.device}, q on {q.device}")


def prefill_attention_reference(q, k_cache, v_cache, query_start_loc, seq_lens, page_tables,
                                scale: float, k_scale=None, v_scale=None):
    """The same function in plain torch (float32 math), one sequence at a time."""
    import torch

    num_heads, head_dim = q.shape[1], q.shape[2]
    page_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    out = torch.empty_like(q)
    for seq in range(seq_lens.shape[0]):
        start, end = int(query_start_loc[seq]), int(query_start_loc[seq + 1])
        length = int(seq_lens[seq])
        pages = page_tables[seq, : (length + page_size - 1) // page_size].long()
        k = gathered_kv(k_cache, k_scale, pages, length)
        v = gathered_kv(v_cache, v_scale, pages, length)
        k = k.repeat_interleave(num_heads // num_kv_heads, dim=1)          # [L, Hq, D]
        v = v.repeat_interleave(num_heads // num_kv_heads, dim=1)
        positions = torch.arange(length - (end - start), length, device=q.device)
        visible = torch.arange(length, device=q.device)[None, :] <= positions[:, None]     # [Q, L]
        scores = torch.einsum("qhd,lhd->hql", q[start:end].float(), k) * scale
        scores = scores.masked_fill(~visible, float("-inf"))
        out[start:end] = torch.einsum("hql,lhd->qhd", scores.softmax(dim=-1), v).to(q.dtype)
    return out


def write_kv_reference(k, v, k_cache, v_cache, slot_mapping) -> None:
    keep = slot_mapping >= 0
    k_cache.view(-1, *k_cache.shape[2:])[slot_mapping[keep]] = k[keep]
    v_cache.view(-1, *v_cache.shape[2:])[slot_mapping[keep]] = v[keep]
