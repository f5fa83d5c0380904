"""The Triton backend of latent attention: flare.engine.mla_attention's contract on our paged kernels.

Writes the new cache rows at slot_mapping (quantized for an FP8 cache), then runs the latent decode kernel
(split-K, every head of a block over each row read once) when every sequence brings one token, and the
latent prefill kernel otherwise; a mixed step's leading one-token sequences (`meta.num_decodes`) take the
decode kernel and the rest the prefill kernel, as the dense backend splits them. It is a `TritonBackend`,
so the decode and prompt graphs take it as they take the dense one (its `interceptor` splits the forward
for the piecewise prompt graphs; `attend` is the attention itself). Hot path: nothing here but dispatch.
"""

from __future__ import annotations

import torch

from flare.engine.attention import AttentionMetadata
from flare.engine.attention_triton import TritonBackend
from flare.engine.mla_attention import cache_views, write_latent


class MlaTritonBackend(TritonBackend):
    """Latent attention through flare.kernels.mla_decode / mla_prefill (CUDA; Triton's interpreter on CPU).
    `decode_splits`: as TritonBackend's (None: chosen per call from meta.max_seq_len)."""

    def attend(self, query, key, value, kv_cache, meta: AttentionMetadata, scale: float,
               out: torch.Tensor | None = None) -> torch.Tensor:
        from flare.kernels.mla_decode import choose_mla_splits, mla_decode
        from flare.kernels.mla_prefill import mla_prefill

        latent_dim, rank = key.shape[-1], value.shape[-1]
        cache = cache_views(kv_cache, latent_dim, rank)
        write_latent(cache, key.reshape(-1, latent_dim), meta.slot_mapping)
        rows, scales = (cache, None) if isinstance(cache, torch.Tensor) else (cache.values, cache.scales)
        num_heads = query.shape[1]
        if out is None:
            out = query.new_empty(query.shape[0], num_heads, rank)
        decodes = meta.seq_lens.shape[0] if meta.max_query_len == 1 else meta.num_decodes
        if decodes:
            splits = self.decode_splits or choose_mla_splits(decodes, num_heads, meta.max_seq_len)
            mla_decode(query[:decodes], rows, meta.page_tables[:decodes], meta.seq_lens[:decodes], scale, rank,
                       splits, out[:decodes], scales=scales)
        if meta.max_query_len > 1:
            # Not slices of the metadata: offset pointers would change the kernel's alignment specialization.
            mla_prefill(query, rows, meta.query_start_loc, meta.seq_lens, meta.page_tables, scale, rank,
                        meta.max_query_len, out, first_seq=decodes, scales=scales)
        return out
