"""DeepSeek V4's attention over a sliding window and compressed entries, and its lightning indexer, in
plain torch: the CPU path, and the truth the Triton kernels (`flare.kernels.compressed_attention`) are
tested against. Imports no Triton.

The caches are paged by blocks of `page_size` sequence tokens (flare.models.cache_spec):
    window_kv     [window pages, page_size, D]        one key (= value) row per token
    window_tables [B, max_blocks] int32               sequence b's window page of block j (stale below its window)
    entries       [tokens pages, page_size / m, D]    compressed entry e of a sequence sits in page
                                                      page_tables[b, e // rows] at row e % rows (rows = page_size / m)
    page_tables  [B, max_blocks] int32
A query token t of sequence `seq_index[t]` at `positions[t]` reads the window keys at positions
max(0, p - window + 1) .. p and either the compressed entries `entry_ids[t]` (CSA: the indexer's choice,
-1 for none) or entries 0 .. `entry_counts[t]` - 1 (HCA: all it may see). A learned sink per head joins the
softmax and takes no value.
"""

from __future__ import annotations

import torch


def gather_window(window_kv: torch.Tensor, window_tables: torch.Tensor, seq_index: torch.Tensor,
                  positions: torch.Tensor, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(keys [T, window, D], valid [T, window]): each token's window, oldest first."""
    page_size = window_kv.shape[1]
    key_positions = positions[:, None] - window + 1 + torch.arange(window, device=positions.device)[None, :]
    valid = key_positions >= 0
    clamped = key_positions.clamp(min=0)
    pages = window_tables[seq_index[:, None], clamped // page_size].long()
    return window_kv[pages, clamped % page_size], valid


def gather_entries(entries: torch.Tensor, page_tables: torch.Tensor, seq_index: torch.Tensor,
                   ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(rows [T, K, C], valid [T, K]) of compressed entries `ids` [T, K] (-1: none)."""
    rows_per_page = entries.shape[1]
    valid = ids >= 0
    clamped = ids.clamp(min=0).long()
    pages = page_tables[seq_index[:, None], clamped // rows_per_page].long()
    return entries[pages, clamped % rows_per_page], valid


def dense_entry_ids(entry_counts: torch.Tensor) -> torch.Tensor:
    """[T, max count] int64: entries 0 .. count - 1 of each token, -1 beyond."""
    width = int(entry_counts.max()) if entry_counts.numel() else 0
    ids = torch.arange(width, device=entry_counts.device)[None, :].expand(entry_counts.shape[0], width)
    return torch.where(ids < entry_counts[:, None], ids, torch.full_like(ids, -1))


def sparse_attention_reference(query: torch.Tensor, window_kv: torch.Tensor, window_tables: torch.Tensor,
                               seq_index: torch.Tensor, positions: torch.Tensor, window: int,
                               sinks: torch.Tensor, scale: float, entries: torch.Tensor | None = None,
                               page_tables: torch.Tensor | None = None, entry_ids: torch.Tensor | None = None,
                               entry_counts: torch.Tensor | None = None) -> torch.Tensor:
    """query [T, H, D] -> [T, H, D] in query's dtype; float32 inside (module docstring for the rest)."""
    keys, valid = gather_window(window_kv, window_tables, seq_index, positions, window)
    if entries is not None:
        ids = entry_ids if entry_ids is not None else dense_entry_ids(entry_counts)
        compressed, valid_entries = gather_entries(entries, page_tables, seq_index, ids)
        keys, valid = torch.cat([keys, compressed], dim=1), torch.cat([valid, valid_entries], dim=1)
    keys = keys.float()
    scores = torch.einsum("thd,tkd->thk", query.float(), keys) * scale
    scores = scores.masked_fill(~valid[:, None, :], float("-inf"))
    sink = sinks.float()[None, :, None].expand(scores.shape[0], -1, 1)
    logits = torch.cat([scores, sink], dim=-1)
    probs = (logits - logits.amax(dim=-1, keepdim=True)).softmax(dim=-1)[..., :-1]
    return torch.einsum("thk,tkd->thd", probs, keys).to(query.dtype)


def indexer_scores_reference(query: torch.Tensor, head_weights: torch.Tensor, keys: torch.Tensor,
                             page_tables: torch.Tensor, seq_index: torch.Tensor, visible: torch.Tensor,
                             scale: float) -> torch.Tensor:
    """The lightning indexer's score of every entry a token may see, sum_h w[t, h] relu(q[t, h] . k[e]) * scale:
    query [T, Hi, Di], head_weights [T, Hi] float32, keys [pages, rows, Di] paged as `entries` above,
    visible [T] (entries 0 .. visible - 1) -> [T, max visible] float32, -inf past each token's visible."""
    ids = dense_entry_ids(visible)
    rows, valid = gather_entries(keys, page_tables, seq_index, ids)
    scores = torch.relu(torch.einsum("thd,tkd->thk", query.float(), rows.float())) * scale
    scores = (scores * head_weights.float()[:, :, None]).sum(dim=1)
    return scores.masked_fill(~valid, float("-inf"))


def top_entries(scores: torch.Tensor, visible: torch.Tensor, topk: int) -> torch.Tensor:
    """[T, min(topk, width)] int64: each token's highest-scoring visible entries (-1 where it sees fewer).
    Equal scores go to the earlier entry (a stable sort), so the choice never depends on the batch; the
    model leaves ties open (transformers' topk breaks them by the row's length), and with many indexer
    heads an exact tie (every head's product negative) does not occur."""
    k = min(topk, scores.shape[1])
    chosen = scores.sort(dim=-1, descending=True, stable=True).indices[:, :k]
    return torch.where(chosen < visible[:, None], chosen, torch.full_like(chosen, -1))


def indexer_topk_reference(query, head_weights, keys, page_tables, seq_index, visible, scale, topk):
    """The indexer's choice per token (top_entries of indexer_scores_reference)."""
    return top_entries(indexer_scores_reference(query, head_weights, keys, page_tables, seq_index, visible, scale),
                       visible, topk)
