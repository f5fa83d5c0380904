"""Prefill/extend attention over paged KV, tuned for Hopper: the kernel the Triton backend runs for prompts.

Same function as `flare.kernels.prefill_attention.prefill_attention` (whose torch reference and K/V
write it shares): each sequence's new tokens attend to its cached prefix and causally to each other,
GQA, over the paged cache (bf16/fp16/fp32, or e4m3 with a float32 scale per token and KV head). What
differs is how the work is laid out for SM90:

* Large tiles: 128 query rows against 64-128 keys per step, so each K/V tile read from L2 feeds 128
  rows of tensor-core work; a key tile spans several pages (page size 16), its page ids gathered from
  the page table per tile, and the loads are plain pointer gathers that Triton's software pipeliner
  turns into `cp.async` stages (`num_stages`) feeding `wgmma`. TMA cannot fetch a tile whose rows
  come from scattered pages on Hopper (TMA gather is Blackwell's), so K/V are not descriptor loads.
* The softmax works in base 2 with the scale folded into one multiply-add per score
  (`exp2(s * scale - m)`), the running maximum taken on the raw scores.
* Causal tile skipping: key tiles wholly before a query tile's first position run without any mask;
  only the diagonal tile(s) mask; tiles past its last position are never visited.
* The key loop is a `tl.range` with `num_stages`, which pipelines every load of the loop (the page
  ids too), not only those feeding a dot as the kernel-wide `num_stages` does.
* Query tiles are launched longest first, the query heads of one KV head side by side (they read the
  same K/V while it is in L2).

Not used: Triton's automatic warp specialization (`tl.range(warp_specialize=True)`), which its
documentation limits to Blackwell GPUs and simple matmul loops.

The launch knobs (tiles, warps, stages) default to the best measured configuration; the benchmark
`benchmarks/prefill_attention_bench.py` sweeps them on the GPU and prints the winner.

Shapes: as flare.kernels.prefill_attention (q [T, Hq, D]; caches [num_pages, page_size, Hkv, D];
query_start_loc [B+1] int32; seq_lens [B] int32; page_tables [B, max_pages] int32; out [T, Hq, D]).
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from flare.kernels.decode_attention import check_kv_scales
from flare.kernels.prefill_attention import LOG2E, _check_inputs


@dataclass(frozen=True)
class FlashConfig:
    """One launch configuration of the kernel."""

    block_m: int = 128             # query rows per program
    block_n: int = 128             # keys per inner step (their pages gathered per key)
    num_warps: int = 8
    num_stages: int = 3            # loads in flight in the key loop


# The configuration a 2-byte GPU launch takes unless told otherwise: 128 x 128 tiles, 8 warps, 3 stages,
# the best of the previous kernel's H200 sweep (benchmarks/results/prefill_sweep.json); benchmarks/
# prefill_attention_bench.py measures the alternatives for this kernel and prints the best.
GPU_DEFAULT = FlashConfig(block_m=128, block_n=128, num_warps=8, num_stages=3)
FLOAT32_DEFAULT = FlashConfig(block_m=64, block_n=32, num_warps=4, num_stages=2)   # tests only: tf32 dots
INTERPRETER_DEFAULT = FlashConfig(block_m=16, block_n=16, num_warps=4, num_stages=1)


@triton.jit
def _key_tile(k_ptr, v_ptr, ks_ptr, vs_ptr, page_table_ptr, kv_head, tokens, dims, limit,
              stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_sp, stride_ss,
              PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
              MASKED: tl.constexpr, FP8_KV: tl.constexpr):
    """K [BLOCK_N, BLOCK_D], V [BLOCK_N, BLOCK_D] of `tokens` (gathered through the page table) and,
    for an FP8 cache, their scales [BLOCK_N] (ones otherwise). MASKED: tokens >= limit read as zero."""
    if MASKED:
        token_mask = tokens < limit
        pages = tl.load(page_table_ptr + tokens // PAGE_SIZE, mask=token_mask, other=0).to(tl.int64)
    else:
        pages = tl.load(page_table_ptr + tokens // PAGE_SIZE).to(tl.int64)
    offsets = tokens % PAGE_SIZE
    k_rows = pages * stride_kp + offsets * stride_ks + kv_head * stride_kh
    v_rows = pages * stride_vp + offsets * stride_vs + kv_head * stride_vh
    k_ptrs = k_ptr + k_rows[:, None] + dims[None, :]
    v_ptrs = v_ptr + v_rows[:, None] + dims[None, :]
    if MASKED:
        if HEAD_DIM != BLOCK_D:
            mask = token_mask[:, None] & (dims < HEAD_DIM)[None, :]
        else:
            mask = token_mask[:, None]
        k = tl.load(k_ptrs, mask=mask, other=0.0)
        v = tl.load(v_ptrs, mask=mask, other=0.0)
    elif HEAD_DIM != BLOCK_D:
        k = tl.load(k_ptrs, mask=(dims < HEAD_DIM)[None, :], other=0.0)
        v = tl.load(v_ptrs, mask=(dims < HEAD_DIM)[None, :], other=0.0)
    else:                                                          # the bulk: no masks, 16-byte loads
        k = tl.load(k_ptrs)
        v = tl.load(v_ptrs)
    if FP8_KV:
        scale_offsets = pages * stride_sp + offsets * stride_ss + kv_head
        if MASKED:
            k_scale = tl.load(ks_ptr + scale_offsets, mask=token_mask, other=0.0)
            v_scale = tl.load(vs_ptr + scale_offsets, mask=token_mask, other=0.0)
        else:
            k_scale = tl.load(ks_ptr + scale_offsets)
            v_scale = tl.load(vs_ptr + scale_offsets)
    else:
        k_scale = tl.full([BLOCK_N], 1.0, tl.float32)             # unused
        v_scale = k_scale
    return k, v, k_scale, v_scale


@triton.jit
def _attend(acc, m, l, q, positions, k_ptr, v_ptr, ks_ptr, vs_ptr, page_table_ptr, kv_head, start, end, limit,
            qk_scale_log2, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh, stride_sp, stride_ss,
            PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr,
            MASKED: tl.constexpr, FP8_KV: tl.constexpr, NUM_STAGES: tl.constexpr):
    """Online softmax (base 2) of one query tile over keys [start, end). MASKED: the diagonal tiles
    (causal mask, and keys from `limit` on hidden); otherwise every key is visible to every row."""
    dims = tl.arange(0, BLOCK_D)
    for n0 in tl.range(start, end, BLOCK_N, num_stages=NUM_STAGES):
        tokens = n0 + tl.arange(0, BLOCK_N)
        k, v, k_scale, v_scale = _key_tile(k_ptr, v_ptr, ks_ptr, vs_ptr, page_table_ptr, kv_head, tokens, dims,
                                           limit, stride_kp, stride_ks, stride_kh, stride_vp, stride_vs, stride_vh,
                                           stride_sp, stride_ss, PAGE_SIZE, HEAD_DIM, BLOCK_D, BLOCK_N, MASKED,
                                           FP8_KV)
        if FP8_KV:      # keys' scales go into the scores, values are dequantized in registers
            scores = tl.dot(q, tl.trans(k.to(q.dtype))) * (k_scale * qk_scale_log2)[None, :]
            v = (v.to(tl.float32) * v_scale[:, None]).to(q.dtype)
            scale = 1.0
        else:
            scores = tl.dot(q, tl.trans(k))
            scale = qk_scale_log2
        if MASKED:
            visible = (tokens[None, :] <= positions[:, None]) & (tokens < limit)[None, :]
            scores = tl.where(visible, scores * scale, float("-inf"))
            m_new = tl.maximum(m, tl.max(scores, axis=1))
            p = tl.exp2(scores - m_new[:, None])
        else:
            m_new = tl.maximum(m, tl.max(scores, axis=1) * scale)
            p = tl.exp2(scores * scale - m_new[:, None])           # one multiply-add per score
        alpha = tl.exp2(m - m_new)
        l = l * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None]
        acc = tl.dot(p.to(v.dtype), v, acc)
        m = m_new
    return acc, m, l


# Integer arguments that vary from step to step are not specialized: every value would otherwise
# compile its own variant in the middle of serving.
@triton.jit(do_not_specialize=["first_seq", "stride_pt"])
def _flash_prefill_kernel(
    q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, out_ptr, query_start_loc_ptr, seq_lens_ptr, page_tables_ptr,
    qk_scale_log2, first_seq,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_kp, stride_ks, stride_kh,
    stride_vp, stride_vs, stride_vh,
    stride_sp, stride_ss,
    stride_pt,
    PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FP8_KV: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    head = tl.program_id(0)                                        # fastest: a KV head's query heads together
    q_block = tl.num_programs(1) - 1 - tl.program_id(1)           # the longest rows first: a shorter tail
    seq = first_seq + tl.program_id(2)
    kv_head = head // GROUP

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_block * BLOCK_M < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        prefix_len = seq_len - q_len
        rows = q_block * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < q_len
        positions = prefix_len + rows                              # absolute position of each query
        dims = tl.arange(0, BLOCK_D)
        io_mask = row_mask[:, None] & (dims < HEAD_DIM)[None, :]
        q_rows = (q_start + rows).to(tl.int64)
        q = tl.load(q_ptr + q_rows[:, None] * stride_qt + head * stride_qh + dims[None, :], mask=io_mask, other=0.0)

        m = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        # Keys before the tile's first query position are visible to every row; keys past its last
        # query are visible to none.
        unmasked_end = (prefix_len + q_block * BLOCK_M) // BLOCK_N * BLOCK_N
        kv_end = tl.minimum(seq_len, prefix_len + (q_block + 1) * BLOCK_M)
        page_table_ptr = page_tables_ptr + seq * stride_pt
        acc, m, l = _attend(acc, m, l, q, positions, k_ptr, v_ptr, ks_ptr, vs_ptr, page_table_ptr, kv_head,
                            0, unmasked_end, kv_end, qk_scale_log2, stride_kp, stride_ks, stride_kh,
                            stride_vp, stride_vs, stride_vh, stride_sp, stride_ss,
                            PAGE_SIZE, HEAD_DIM, BLOCK_D, BLOCK_N, False, FP8_KV, NUM_STAGES)
        acc, m, l = _attend(acc, m, l, q, positions, k_ptr, v_ptr, ks_ptr, vs_ptr, page_table_ptr, kv_head,
                            unmasked_end, kv_end, kv_end, qk_scale_log2, stride_kp, stride_ks, stride_kh,
                            stride_vp, stride_vs, stride_vh, stride_sp, stride_ss,
                            PAGE_SIZE, HEAD_DIM, BLOCK_D, BLOCK_N, True, FP8_KV, NUM_STAGES)

        o = acc / l[:, None]                                       # every row sees at least its own key
        tl.store(out_ptr + q_rows[:, None] * stride_ot + head * stride_oh + dims[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=io_mask)


def default_config(q) -> FlashConfig:
    if q.device.type == "cpu":                                     # the interpreter: small tiles keep it quick
        return INTERPRETER_DEFAULT
    return FLOAT32_DEFAULT if q.element_size() > 2 else GPU_DEFAULT


def flash_prefill_attention(q, k_cache, v_cache, query_start_loc, seq_lens, page_tables, scale: float,
                            max_query_len: int, out=None, *, first_seq: int = 0, k_scale=None, v_scale=None,
                            config: FlashConfig | None = None):
    """Causal attention of each sequence's new tokens over its paged context; returns out [T, Hq, D].

    `first_seq`: sequences before it are left alone (a mixed step serves them as decodes); their rows
    of `out` are not written. k_scale/v_scale come with an FP8 cache. `config`: the launch (benchmarks)."""
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
    config = config or default_config(q)
    for name in ("block_m", "block_n"):
        size = getattr(config, name)
        if size < 16 or size & (size - 1):
            raise ValueError(f"{name} {size}: tiles are powers of two of at least 16 (tl.dot's smallest)")
    launch = {} if q.device.type == "cpu" else {"num_warps": config.num_warps, "num_stages": config.num_stages}
    fp8 = k_scale is not None
    grid = (num_heads, triton.cdiv(max_query_len, config.block_m), batch - first_seq)
    _flash_prefill_kernel[grid](
        q, k_cache, v_cache, k_scale if fp8 else q, v_scale if fp8 else q, out, query_start_loc, seq_lens,
        page_tables,
        scale * LOG2E, first_seq,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        k_scale.stride(0) if fp8 else 0, k_scale.stride(1) if fp8 else 0,
        page_tables.stride(0),
        PAGE_SIZE=page_size, GROUP=num_heads // num_kv_heads, HEAD_DIM=head_dim,
        BLOCK_D=triton.next_power_of_2(head_dim), BLOCK_M=config.block_m, BLOCK_N=config.block_n, FP8_KV=fp8,
        NUM_STAGES=config.num_stages, **launch,
    )
    return out
