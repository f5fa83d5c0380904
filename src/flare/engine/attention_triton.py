"""The Triton attention backend: the AttentionBackend contract on our paged kernels.

Writes the new K/V at slot_mapping, then runs split-K decode attention when every sequence brings one
new token, and prefill/extend attention otherwise. Hot path: nothing here but dispatch.
"""

from __future__ import annotations

import torch

from flare.engine.attention import AttentionBackend, AttentionMetadata


class TritonBackend(AttentionBackend):
    """Paged attention through the Triton kernels of flare.kernels (CUDA; Triton's interpreter on CPU).

    decode_splits fixes the split-K count of decode attention. A captured CUDA graph needs it fixed:
    pass choose_num_splits(batch, num_kv_heads, longest context the graph serves). Left None, it is
    chosen per call from meta.max_seq_len.
    """

    def __init__(self, decode_splits: int | None = None):
        self.decode_splits = decode_splits

    def forward(self, query, key, value, kv_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        from flare.kernels.decode_attention import choose_num_splits, decode_attention
        from flare.kernels.prefill_attention import prefill_attention, write_kv

        k_cache, v_cache = kv_cache[0], kv_cache[1]
        write_kv(key.to(kv_cache.dtype), value.to(kv_cache.dtype), k_cache, v_cache, meta.slot_mapping)
        batch = meta.seq_lens.shape[0]
        if meta.max_query_len == 1 and query.shape[0] == batch:
            splits = self.decode_splits or choose_num_splits(batch, k_cache.shape[2], meta.max_seq_len)
            return decode_attention(query, k_cache, v_cache, meta.block_tables, meta.seq_lens, scale, splits)
        return prefill_attention(query, k_cache, v_cache, meta.query_start_loc, meta.seq_lens,
                                 meta.block_tables, scale, max_query_len=meta.max_query_len)
