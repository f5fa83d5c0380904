"""Prefill/extend attention over a latent cache (MLA, absorbed form): each sequence's new tokens attend to
its cached prefix and causally to each other.

The rows of one program are `BLOCK_Q` consecutive new tokens times `BLOCK_H` heads (all heads share the
cached rows, so a tile of rows read once feeds every one of them); a row's position is its token's.
As flare.kernels.flash_prefill: key tiles wholly before the block's first position run unmasked, the
diagonal ones masked, those past its last position are never visited; the longest query blocks launch
first. The cache row is `[latent, rotary key]` (flare.engine.mla_attention); the value is the latent,
so the accumulator is [rows, L]: at L = 512 it is what bounds the rows per program.

Speculative verification's steps (a few tokens per sequence) and prompt chunks both take this kernel;
decodes take flare.kernels.mla_decode.

Shapes: q [T, H, L + R]; cache as mla_decode's; query_start_loc [B + 1] int32; seq_lens [B] int32
(context after the step); page_tables [B, max_pages] int32; out [T, H, L].
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from flare.kernels.decode_attention import LOG2E
from flare.kernels.mla_decode import block_heads, check_latent_inputs, latent_scores, latent_softmax_step, latent_tile


@dataclass(frozen=True)
class MlaPrefillConfig:
    block_q: int = 2               # new tokens per program (times the head block: its rows)
    block_n: int = 32              # cached tokens per inner step
    num_warps: int = 8
    num_stages: int = 2


# A first choice for 2-byte GPU launches: 2 tokens x 16 heads = 32 rows keep the [32, 512] float32
# accumulator in registers; benchmarks/mla_attention_bench.py sweeps the alternatives.
GPU_DEFAULT = MlaPrefillConfig()
INTERPRETER_DEFAULT = MlaPrefillConfig(block_q=2, block_n=16, num_warps=4, num_stages=1)


@triton.jit
def _attend_rows(acc, m, l, q_lat, q_pe, positions, cache_ptr, scales_ptr, page_table_ptr, start, end, limit,
                 qk_scale_log2, stride_cp, stride_cs, stride_sp, stride_ss,
                 PAGE_SIZE: tl.constexpr, RANK: tl.constexpr, ROPE: tl.constexpr, BLOCK_L: tl.constexpr,
                 BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, MASKED: tl.constexpr, FP8: tl.constexpr,
                 NUM_STAGES: tl.constexpr):
    """Online softmax (base 2) of the program's rows over cached tokens [start, end); MASKED: the diagonal
    tiles (causal mask, tokens from `limit` on hidden)."""
    lat = tl.arange(0, BLOCK_L)
    pe = tl.arange(0, BLOCK_P)
    for n0 in tl.range(start, end, BLOCK_N, num_stages=NUM_STAGES):
        tokens = n0 + tl.arange(0, BLOCK_N)
        token_mask = tokens < limit
        pages = tl.load(page_table_ptr + tokens // PAGE_SIZE, mask=token_mask, other=0).to(tl.int64)
        k_lat, k_pe, lat_scale, pe_scale = latent_tile(cache_ptr, scales_ptr, pages, tokens % PAGE_SIZE, token_mask,
                                                       lat, pe, stride_cp, stride_cs, stride_sp, stride_ss,
                                                       RANK, ROPE, BLOCK_L, BLOCK_P, FP8)
        scores = latent_scores(q_lat, q_pe, k_lat, k_pe, lat_scale, pe_scale, FP8)
        if not FP8:
            scores = scores * qk_scale_log2
        if MASKED:
            visible = (tokens[None, :] <= positions[:, None]) & token_mask[None, :]
            scores = tl.where(visible, scores, float("-inf"))
        acc, m, l = latent_softmax_step(acc, m, l, scores, k_lat, lat_scale, FP8)
    return acc, m, l


@triton.jit(do_not_specialize=["first_seq", "stride_pt"])
def _mla_prefill_kernel(
    q_ptr, cache_ptr, scales_ptr, out_ptr, query_start_loc_ptr, seq_lens_ptr, page_tables_ptr,
    qk_scale_log2, first_seq,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_cp, stride_cs, stride_sp, stride_ss,
    stride_pt,
    NUM_HEADS: tl.constexpr, PAGE_SIZE: tl.constexpr, RANK: tl.constexpr, ROPE: tl.constexpr,
    BLOCK_L: tl.constexpr, BLOCK_P: tl.constexpr, BLOCK_H: tl.constexpr, BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr, FP8: tl.constexpr, NUM_STAGES: tl.constexpr,
):
    head_block = tl.program_id(0)
    q_block = tl.num_programs(1) - 1 - tl.program_id(1)           # the longest rows first: a shorter tail
    seq = first_seq + tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if q_block * BLOCK_Q < q_len:
        seq_len = tl.load(seq_lens_ptr + seq)
        prefix_len = seq_len - q_len
        rows = tl.arange(0, BLOCK_Q * BLOCK_H)
        token = q_block * BLOCK_Q + rows // BLOCK_H                # the row's new token, within the sequence
        heads = head_block * BLOCK_H + rows % BLOCK_H
        row_mask = (token < q_len) & (heads < NUM_HEADS)
        positions = prefix_len + token
        lat = tl.arange(0, BLOCK_L)
        pe = tl.arange(0, BLOCK_P)
        q_rows = q_ptr + (q_start + token).to(tl.int64)[:, None] * stride_qt + heads[:, None] * stride_qh
        q_lat = tl.load(q_rows + lat[None, :], mask=row_mask[:, None] & (lat < RANK)[None, :], other=0.0)
        q_pe = tl.load(q_rows + RANK + pe[None, :], mask=row_mask[:, None] & (pe < ROPE)[None, :], other=0.0)
        if FP8:
            q_lat = (q_lat.to(tl.float32) * qk_scale_log2).to(tl.float16)
            q_pe = (q_pe.to(tl.float32) * qk_scale_log2).to(tl.float16)

        m = tl.full([BLOCK_Q * BLOCK_H], float("-inf"), dtype=tl.float32)
        l = tl.zeros([BLOCK_Q * BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_Q * BLOCK_H, BLOCK_L], dtype=tl.float32)
        unmasked_end = (prefix_len + q_block * BLOCK_Q) // BLOCK_N * BLOCK_N
        kv_end = tl.minimum(seq_len, prefix_len + (q_block + 1) * BLOCK_Q)
        page_table_ptr = page_tables_ptr + seq * stride_pt
        acc, m, l = _attend_rows(acc, m, l, q_lat, q_pe, positions, cache_ptr, scales_ptr, page_table_ptr,
                                 0, unmasked_end, kv_end, qk_scale_log2, stride_cp, stride_cs, stride_sp, stride_ss,
                                 PAGE_SIZE, RANK, ROPE, BLOCK_L, BLOCK_P, BLOCK_N, False, FP8, NUM_STAGES)
        acc, m, l = _attend_rows(acc, m, l, q_lat, q_pe, positions, cache_ptr, scales_ptr, page_table_ptr,
                                 unmasked_end, kv_end, kv_end, qk_scale_log2, stride_cp, stride_cs, stride_sp,
                                 stride_ss, PAGE_SIZE, RANK, ROPE, BLOCK_L, BLOCK_P, BLOCK_N, True, FP8, NUM_STAGES)
        o = acc / tl.where(l > 0, l, 1.0)[:, None]                # masked rows (past the heads) stay 0
        out_rows = out_ptr + (q_start + token).to(tl.int64)[:, None] * stride_ot + heads[:, None] * stride_oh
        tl.store(out_rows + lat[None, :], o.to(out_ptr.dtype.element_ty),
                 mask=row_mask[:, None] & (lat < RANK)[None, :])


def mla_prefill(q, cache, query_start_loc, seq_lens, page_tables, scale: float, kv_lora_rank: int,
                max_query_len: int, out=None, *, first_seq: int = 0, scales=None,
                config: MlaPrefillConfig | None = None):
    """Causal latent attention of each sequence's new tokens over its paged context; returns out [T, H, L].

    `first_seq`: sequences before it are left alone (a mixed step serves them as decodes); their rows of
    `out` are not written. `scales` come with an FP8 cache; `config` is the launch (benchmarks)."""
    check_latent_inputs(q, cache, page_tables, seq_lens, kv_lora_rank, scales)
    num_tokens, num_heads, width = q.shape
    batch = seq_lens.shape[0]
    if out is None:
        out = q.new_empty(num_tokens, num_heads, kv_lora_rank)
    elif tuple(out.shape) != (num_tokens, num_heads, kv_lora_rank) or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"out must be {[num_tokens, num_heads, kv_lora_rank]} {q.dtype} with a contiguous last dim")
    if not 0 <= first_seq <= batch:
        raise ValueError(f"first_seq {first_seq} is outside the batch of {batch} sequences")
    if num_tokens == 0 or batch == first_seq:
        return out
    on_cpu = q.device.type == "cpu"
    config = config or (INTERPRETER_DEFAULT if on_cpu else GPU_DEFAULT)
    block_h = block_heads(num_heads)
    if config.block_q < 1 or config.block_q & (config.block_q - 1) or config.block_n < 16 \
            or config.block_n & (config.block_n - 1):
        raise ValueError(f"{config}: block_q is a power of two, block_n a power of two of at least 16")
    launch = {} if on_cpu else {"num_warps": config.num_warps, "num_stages": config.num_stages}
    fp8 = scales is not None
    rope = width - kv_lora_rank
    grid = (triton.cdiv(num_heads, block_h), triton.cdiv(max_query_len, config.block_q), batch - first_seq)
    _mla_prefill_kernel[grid](
        q, cache, scales if fp8 else q, out, query_start_loc, seq_lens, page_tables,
        scale * LOG2E, first_seq,
        q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        cache.stride(0), cache.stride(1),
        scales.stride(0) if fp8 else 0, scales.stride(1) if fp8 else 0,
        page_tables.stride(0),
        NUM_HEADS=num_heads, PAGE_SIZE=cache.shape[1], RANK=kv_lora_rank, ROPE=rope,
        BLOCK_L=triton.next_power_of_2(kv_lora_rank), BLOCK_P=max(16, triton.next_power_of_2(rope)),
        BLOCK_H=block_h, BLOCK_Q=config.block_q, BLOCK_N=config.block_n, FP8=fp8,
        NUM_STAGES=config.num_stages, **launch,
    )
    return out


def mla_prefill_reference(q, cache, query_start_loc, seq_lens, page_tables, scale: float, kv_lora_rank: int,
                          scales=None):
    """The same function in plain torch (float32 math), one sequence at a time."""
    from flare.kernels.mla_reference import LatentCacheFp8, gather_latent, latent_attention

    view = cache if scales is None else LatentCacheFp8(cache, scales, kv_lora_rank)
    out = q.new_empty(q.shape[0], q.shape[1], kv_lora_rank)
    starts = query_start_loc.tolist()
    for seq, length in enumerate(seq_lens.tolist()):
        rows = gather_latent(view, page_tables[seq], length)
        out[starts[seq]:starts[seq + 1]] = latent_attention(q[starts[seq]:starts[seq + 1]], rows, kv_lora_rank, scale)
    return out
