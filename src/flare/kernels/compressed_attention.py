"""DeepSeek V4's attention over a sliding window and compressed entries, and its lightning indexer, in
Triton (the torch references and the cache layout: flare.kernels.compressed_attention_reference).

`sparse_attention`: one program per query token and block of query heads. The token's keys are its window
(positions max(0, p - window + 1) .. p, read from the window pages) and then its compressed entries, either
the indexer's list (CSA, -1 for none) or entries 0 .. count - 1 (HCA); the one KV head is key and value,
so each key row is read once for the scores and the output of every head of the block. An online softmax
over both, in log2 units, and the sink folded into the normaliser at the end.

`indexer_topk`: one program per query token and block of entries computes the scores
sum_h w[t, h] relu(q[t, h] . k[e]) * scale of the entries it may see (-inf beyond), then torch takes each
token's top-k with a stable sort (ties to the earlier entry, as the reference), INDEXER_QUERY_BLOCK tokens
at a time so that a million-token context holds 512 rows of scores, not a prompt chunk's.

Shapes:
    query [T, H, D] (last dim contiguous), window_kv [window pages, page_size, D], window_tables and
    page_tables [B, blocks] int32, seq_index / positions [T] int64, entries [pages, rows, D],
    entry_ids [T, K] int64 (-1: none) or entry_counts [T] int64, sinks [H] float32 -> out [T, H, D].
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from flare.kernels.compressed_attention_reference import dense_entry_ids, top_entries

LOG2E = 1.4426950408889634
BLOCK_H = 16
BLOCK_N = 16
BLOCK_E = 64
INDEXER_QUERY_BLOCK = 512        # the memory model counts this many rows of scores (flare.recipes.deepseek_v4)


@triton.jit
def _keys(kv_ptr, tables_ptr, seq, index, valid, dims, dim_mask, stride_kp, stride_ks, stride_bt, ROWS: tl.constexpr):
    """Rows `index` [BLOCK] of a paged tensor (`ROWS` rows a page), zero where not `valid`."""
    safe = tl.where(valid, index, 0)
    pages = tl.load(tables_ptr + seq * stride_bt + safe // ROWS, mask=valid, other=0).to(tl.int64)
    rows = safe % ROWS
    return tl.load(kv_ptr + pages[:, None] * stride_kp + rows[:, None] * stride_ks + dims[None, :],
                   mask=valid[:, None] & dim_mask[None, :], other=0.0)


@triton.jit
def _fold(acc, m, l, q, keys, valid, qk_scale_log2, PRECISION: tl.constexpr):
    scores = tl.dot(q, tl.trans(keys), input_precision=PRECISION) * qk_scale_log2
    scores = tl.where(valid[None, :], scores, float("-inf"))
    m_new = tl.maximum(m, tl.max(scores, axis=1))
    alpha = tl.exp2(m - m_new)
    p = tl.exp2(scores - m_new[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    acc = acc * alpha[:, None] + tl.dot(p.to(keys.dtype), keys, input_precision=PRECISION)
    return acc, m_new, l


@triton.jit(do_not_specialize=["num_entries", "stride_qt", "stride_qh", "stride_ot", "stride_oh", "stride_it",
                               "stride_wbt", "stride_pbt"])
def _sparse_attention_kernel(
    q_ptr, out_ptr, window_ptr, window_tables_ptr, entries_ptr, page_tables_ptr, ids_ptr, counts_ptr,
    seq_ptr, pos_ptr, sinks_ptr, qk_scale_log2, num_entries,
    stride_qt, stride_qh, stride_ot, stride_oh,
    stride_wp, stride_ws, stride_wbt, stride_ep, stride_es, stride_pbt, stride_it,
    HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HEADS: tl.constexpr,
    BLOCK_KEYS: tl.constexpr, WINDOW: tl.constexpr, PAGE_SIZE: tl.constexpr, ENTRY_ROWS: tl.constexpr,
    MODE: tl.constexpr,                     # 0: window only; 1: entry ids (CSA); 2: entry counts (HCA)
    PRECISION: tl.constexpr,
):
    token = tl.program_id(0)
    heads = tl.program_id(1) * BLOCK_HEADS + tl.arange(0, BLOCK_HEADS)
    head_mask = heads < HEADS
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    seq = tl.load(seq_ptr + token)
    position = tl.load(pos_ptr + token)
    q = tl.load(q_ptr + token * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                mask=head_mask[:, None] & dim_mask[None, :], other=0.0)

    m = tl.full([BLOCK_HEADS], float("-inf"), dtype=tl.float32)
    l = tl.zeros([BLOCK_HEADS], dtype=tl.float32)
    acc = tl.zeros([BLOCK_HEADS, BLOCK_D], dtype=tl.float32)
    first = tl.maximum(position - WINDOW + 1, 0)
    for start in range(0, WINDOW, BLOCK_KEYS):
        index = first + start + tl.arange(0, BLOCK_KEYS)
        valid = index <= position
        keys = _keys(window_ptr, window_tables_ptr, seq, index, valid, dims, dim_mask, stride_wp, stride_ws,
                     stride_wbt, PAGE_SIZE)
        acc, m, l = _fold(acc, m, l, q, keys, valid, qk_scale_log2, PRECISION)
    if MODE != 0:
        count = num_entries
        if MODE == 2:
            count = tl.load(counts_ptr + token)
        for start in range(0, count, BLOCK_KEYS):
            slot = start + tl.arange(0, BLOCK_KEYS)
            if MODE == 1:
                index = tl.load(ids_ptr + token * stride_it + slot, mask=slot < num_entries, other=-1)
                valid = index >= 0
            else:
                index = slot
                valid = slot < count
            keys = _keys(entries_ptr, page_tables_ptr, seq, index, valid, dims, dim_mask, stride_ep, stride_es,
                         stride_pbt, ENTRY_ROWS)
            acc, m, l = _fold(acc, m, l, q, keys, valid, qk_scale_log2, PRECISION)

    sink = tl.load(sinks_ptr + heads, mask=head_mask, other=0.0) * 1.4426950408889634
    top = tl.maximum(m, sink)
    total = l * tl.exp2(m - top) + tl.exp2(sink - top)
    out = acc * (tl.exp2(m - top) / total)[:, None]
    tl.store(out_ptr + token * stride_ot + heads[:, None] * stride_oh + dims[None, :], out.to(q.dtype),
             mask=head_mask[:, None] & dim_mask[None, :])


def _precision(query: torch.Tensor) -> str | None:
    """float32 products in full precision (not TF32): float32 runs are compared token for token with
    transformers; bf16/fp16 take the dot's default."""
    return "ieee" if query.dtype == torch.float32 else None


def sparse_attention(query: torch.Tensor, window_kv: torch.Tensor, window_tables: torch.Tensor,
                     seq_index: torch.Tensor, positions: torch.Tensor, window: int, sinks: torch.Tensor,
                     scale: float, entries: torch.Tensor | None = None, page_tables: torch.Tensor | None = None,
                     entry_ids: torch.Tensor | None = None, entry_counts: torch.Tensor | None = None) -> torch.Tensor:
    """query [T, H, D] -> [T, H, D] (module docstring); the reference's contract."""
    tokens, heads, head_dim = query.shape
    if window_kv.shape[-1] != head_dim or query.stride(-1) != 1:
        raise ValueError(f"query [T, H, {head_dim}] (last dim contiguous) and window keys of the same width; "
                         f"got {list(query.shape)} and {list(window_kv.shape)}")
    if (entries is None) != (page_tables is None) or (entries is not None and (entry_ids is None) == (entry_counts is None)):
        raise ValueError("compressed entries come with their block tables and exactly one of entry_ids, entry_counts")
    out = torch.empty_like(query)
    if tokens == 0:
        return out
    mode = 0 if entries is None else (1 if entry_ids is not None else 2)
    entries = entries if entries is not None else window_kv
    page_tables = page_tables if page_tables is not None else window_tables
    ids = entry_ids.contiguous() if entry_ids is not None else seq_index.view(-1, 1)
    counts = entry_counts.contiguous() if entry_counts is not None else seq_index
    num_entries = ids.shape[1] if mode == 1 else 0
    grid = (tokens, triton.cdiv(heads, BLOCK_H))
    _sparse_attention_kernel[grid](
        query, out, window_kv, window_tables, entries, page_tables, ids, counts,
        seq_index.contiguous(), positions.contiguous(), sinks.float().contiguous(), scale * LOG2E, num_entries,
        query.stride(0), query.stride(1), out.stride(0), out.stride(1),
        window_kv.stride(0), window_kv.stride(1), window_tables.stride(0), entries.stride(0), entries.stride(1),
        page_tables.stride(0), ids.stride(0),
        HEADS=heads, HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_HEADS=BLOCK_H,
        BLOCK_KEYS=BLOCK_N, WINDOW=window, PAGE_SIZE=window_kv.shape[1], ENTRY_ROWS=entries.shape[1], MODE=mode,
        PRECISION=_precision(query), num_warps=8 if head_dim >= 256 else 4)
    return out


@triton.jit(do_not_specialize=["width", "stride_qt", "stride_qh", "stride_wt", "stride_st", "stride_bt"])
def _indexer_scores_kernel(
    q_ptr, weights_ptr, keys_ptr, page_tables_ptr, seq_ptr, visible_ptr, scores_ptr, scale, width,
    stride_qt, stride_qh, stride_wt, stride_kp, stride_ks, stride_bt, stride_st,
    HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_HEADS: tl.constexpr,
    BLOCK: tl.constexpr, ROWS: tl.constexpr, PRECISION: tl.constexpr,
):
    token = tl.program_id(0)
    index = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    seq = tl.load(seq_ptr + token)
    visible = tl.load(visible_ptr + token)
    valid = index < visible
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM
    keys = _keys(keys_ptr, page_tables_ptr, seq, index, valid, dims, dim_mask, stride_kp, stride_ks, stride_bt, ROWS)
    total = tl.zeros([BLOCK], dtype=tl.float32)
    for head_start in range(0, HEADS, BLOCK_HEADS):
        heads = head_start + tl.arange(0, BLOCK_HEADS)
        head_mask = heads < HEADS
        q = tl.load(q_ptr + token * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                    mask=head_mask[:, None] & dim_mask[None, :], other=0.0)
        weights = tl.load(weights_ptr + token * stride_wt + heads, mask=head_mask, other=0.0)
        products = tl.maximum(tl.dot(q, tl.trans(keys.to(q.dtype)), input_precision=PRECISION), 0.0) * scale
        total += tl.sum(products * weights[:, None], axis=0)
    tl.store(scores_ptr + token * stride_st + index, tl.where(valid, total, float("-inf")), mask=index < width)


def indexer_scores(query: torch.Tensor, head_weights: torch.Tensor, keys: torch.Tensor, page_tables: torch.Tensor,
                   seq_index: torch.Tensor, visible: torch.Tensor, scale: float, width: int) -> torch.Tensor:
    """query [T, Hi, Di], head_weights [T, Hi] float32, keys [pages, rows, Di] -> scores [T, width] float32
    (-inf past each token's `visible` entries)."""
    tokens, heads, head_dim = query.shape
    scores = torch.full((tokens, width), float("-inf"), dtype=torch.float32, device=query.device)
    if tokens == 0 or width == 0:
        return scores
    weights = head_weights.float().contiguous()
    grid = (tokens, triton.cdiv(width, BLOCK_E))
    _indexer_scores_kernel[grid](
        query, weights, keys, page_tables, seq_index.contiguous(), visible.contiguous(), scores, scale, width,
        query.stride(0), query.stride(1), weights.stride(0), keys.stride(0), keys.stride(1), page_tables.stride(0),
        scores.stride(0),
        HEADS=heads, HEAD_DIM=head_dim, BLOCK_D=max(16, triton.next_power_of_2(head_dim)), BLOCK_HEADS=BLOCK_H,
        BLOCK=BLOCK_E, ROWS=keys.shape[1], PRECISION=_precision(query))
    return scores


def indexer_topk(query, head_weights, keys, page_tables, seq_index, visible, scale: float, topk: int) -> torch.Tensor:
    """Each token's `topk` highest-scoring visible entries (-1 where it sees fewer), INDEXER_QUERY_BLOCK tokens
    of scores at a time; the reference's contract (flare.kernels.compressed_attention_reference.top_entries)."""
    width = int(visible.max()) if visible.numel() else 0
    chosen = []
    for start in range(0, query.shape[0], INDEXER_QUERY_BLOCK):
        part = slice(start, start + INDEXER_QUERY_BLOCK)
        scores = indexer_scores(query[part], head_weights[part], keys, page_tables, seq_index[part], visible[part],
                                scale, width)
        chosen.append(top_entries(scores, visible[part], topk))
    if not chosen:
        return dense_entry_ids(visible)[:, :0]
    return torch.cat(chosen)
