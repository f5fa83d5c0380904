"""The latent cache's FP8 row format and latent attention in plain torch: the references of
flare.kernels.mla_decode and mla_prefill, and the math flare.engine.mla_attention's CPU backend runs.

A row is `[latent (kv_lora_rank), rotary key (qk_rope_head_dim)]`; in the FP8 format it is e4m3 values
with two float32 scales, the latent's and the rotary key's absolute maximum / 448 (1 for zeros).
No Triton here.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flare.kernels.fp8_reference import quantize_activations_reference


@dataclass(frozen=True)
class LatentCacheFp8:
    """Views of one layer's FP8 latent cache: e4m3 rows [pages, page_size, latent_dim] and their float32
    scales [pages, page_size, 2] (latent's, rotary key's)."""

    values: torch.Tensor
    scales: torch.Tensor
    kv_lora_rank: int


def quantize_latent_rows(rows: torch.Tensor, kv_lora_rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`rows [T, latent_dim]` as e4m3 values [T, latent_dim] and float32 scales [T, 2]."""
    latent, latent_scale = quantize_activations_reference(rows[:, :kv_lora_rank], 0)
    rope, rope_scale = quantize_activations_reference(rows[:, kv_lora_rank:], 0)
    return torch.cat([latent, rope], dim=-1), torch.cat([latent_scale, rope_scale], dim=-1)


def gather_latent(cache: torch.Tensor | LatentCacheFp8, pages: torch.Tensor, seq_len: int) -> torch.Tensor:
    """One sequence's `seq_len` cache rows [seq_len, latent_dim] in position order (float32 from an FP8
    cache: values times their scales)."""
    if isinstance(cache, LatentCacheFp8):
        page_size, rank = cache.values.shape[1], cache.kv_lora_rank
        used = pages[: -(-seq_len // page_size)].long()
        values = cache.values[used].flatten(0, 1)[:seq_len].float()
        scales = cache.scales[used].flatten(0, 1)[:seq_len]
        return torch.cat([values[:, :rank] * scales[:, :1], values[:, rank:] * scales[:, 1:]], dim=-1)
    page_size = cache.shape[1]
    used = pages[: -(-seq_len // page_size)].long()
    return cache[used].flatten(0, 1)[:seq_len]


def latent_attention(query: torch.Tensor, rows: torch.Tensor, kv_lora_rank: int, scale: float) -> torch.Tensor:
    """`query [q, H, latent_dim]` are the last q positions of a context of cache `rows [s, latent_dim]`;
    causal; float32 inside; -> [q, H, kv_lora_rank] in the query's dtype."""
    q_len, seq_len = query.shape[0], rows.shape[0]
    scores = torch.einsum("qhd,sd->hqs", query.float(), rows.float()) * scale
    query_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)[:, None]
    hidden = torch.arange(seq_len, device=query.device)[None, :] > query_pos
    probs = scores.masked_fill(hidden, float("-inf")).softmax(dim=-1)
    return torch.einsum("hqs,sd->qhd", probs, rows[:, :kv_lora_rank].float()).to(query.dtype)
