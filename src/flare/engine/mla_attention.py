"""Multi-head latent attention over a paged latent cache: its layout, its writes, and the torch reference.

MLA (DeepSeek-V2/V3, `flare.models.mla`) keeps one row per token and layer in the cache: the token's
compressed latent (`kv_lora_rank` values, RMS-normed) followed by its rotary key (`qk_rope_head_dim`),
`latent_dim` values in all (576 for V3's shapes), not per-head keys and values. With the up-projections
absorbed, attention is one KV head for every query head:

    query  [T, H, latent_dim]   each head's q_nope through W_UK (latent space), then its rotary query
    key    [T, 1, latent_dim]   the new tokens' cache rows (what is written at slot_mapping)
    value  [T, 1, kv_lora_rank] the latent part of `key` (a view; backends read it from the cache)
    out    [T, H, kv_lora_rank] softmax(query . rows * scale) . latents, which W_UV then takes to v_head_dim

The call keeps the `AttentionBackend` signature (so prompt graphs and compilation treat it as any
attention), with `kv_cache` one layer's latent cache:

    bf16/fp16/fp32: [num_pages, page_size, latent_dim]
    FP8 ("fp8" KV cache dtype): uint8 [num_pages, page_size, latent_dim + 8]: the row's e4m3 values, then
        two float32 scales (the latent's absolute maximum / 448, the rotary key's), chosen when written.

A cached token costs `latent_dim` x 2 bytes per layer at bf16, `latent_dim + 8` at FP8, whatever the
head count (`recipes.base.kv_bytes_per_token` counts that).
"""

from __future__ import annotations

import torch

from flare.engine.attention import AttentionBackend, AttentionMetadata
from flare.kernels.mla_reference import LatentCacheFp8, gather_latent, latent_attention, quantize_latent_rows

LATENT_SCALE_BYTES = 8          # FP8 rows: one float32 scale for the latent, one for the rotary key


def latent_cache_shape(num_pages: int, page_size: int, latent_dim: int, fp8: bool) -> tuple[int, int, int]:
    return (num_pages, page_size, latent_dim + LATENT_SCALE_BYTES if fp8 else latent_dim)


def fp8_latent_views(cache: torch.Tensor, latent_dim: int, kv_lora_rank: int) -> LatentCacheFp8:
    """The e4m3 rows and float32 scales inside a uint8 FP8 latent cache."""
    if cache.dtype != torch.uint8 or cache.shape[-1] != latent_dim + LATENT_SCALE_BYTES:
        raise ValueError(f"an FP8 latent cache of {latent_dim} values is uint8 [..., {latent_dim + LATENT_SCALE_BYTES}]; "
                         f"got {cache.dtype} {list(cache.shape)}")
    values = cache[..., :latent_dim].view(torch.float8_e4m3fn)
    scales = cache[..., latent_dim:].view(torch.float32)
    return LatentCacheFp8(values, scales, kv_lora_rank)


def write_latent(cache: torch.Tensor | LatentCacheFp8, rows: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Store each new token's cache row `rows [T, latent_dim]` at its slot (page * page_size + offset)."""
    if isinstance(cache, LatentCacheFp8):
        values, scales = quantize_latent_rows(rows, cache.kv_lora_rank)
        cache.values.flatten(0, 1)[slot_mapping] = values
        cache.scales.flatten(0, 1)[slot_mapping] = scales
        return
    cache.flatten(0, 1)[slot_mapping] = rows.to(cache.dtype)


def cache_views(kv_cache: torch.Tensor, latent_dim: int, kv_lora_rank: int) -> torch.Tensor | LatentCacheFp8:
    """The layer cache as the rows to read and write: itself, or its FP8 views."""
    return fp8_latent_views(kv_cache, latent_dim, kv_lora_rank) if kv_cache.dtype == torch.uint8 else kv_cache


class MlaReferenceBackend(AttentionBackend):
    """Latent attention in plain PyTorch, one sequence at a time: the yardstick for the Triton kernels,
    and what a CPU serves with."""

    def forward(self, query, key, value, kv_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        latent_dim, rank = key.shape[-1], value.shape[-1]
        cache = cache_views(kv_cache, latent_dim, rank)
        write_latent(cache, key.reshape(-1, latent_dim), meta.slot_mapping)
        output = query.new_empty(query.shape[0], query.shape[1], rank)
        starts = meta.query_start_loc.tolist()
        for b, seq_len in enumerate(meta.seq_lens.tolist()):
            start, end = starts[b], starts[b + 1]
            rows = gather_latent(cache, meta.page_tables[b], seq_len)
            output[start:end] = latent_attention(query[start:end], rows, rank, scale)
        return output


def allocate_latent_caches(cfg, num_pages: int, page_size: int, dtype: torch.dtype, device) -> list[torch.Tensor]:
    """One zeroed latent cache per layer (module docstring's layouts; `cfg.kv_cache_dtype` "fp8": uint8)."""
    fp8 = cfg.kv_cache_dtype == "fp8"
    shape = latent_cache_shape(num_pages, page_size, cfg.mla.latent_dim, fp8)
    return [torch.zeros(shape, dtype=torch.uint8 if fp8 else dtype, device=device)
            for _ in range(cfg.num_hidden_layers)]
