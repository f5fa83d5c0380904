"""Paged attention: the batch metadata, the backend contract, and a pure-PyTorch reference backend.

The KV cache is one tensor per layer, `[2, num_pages, page_size, num_kv_heads, head_dim]` (keys, then
values). A batch is flattened: the new tokens of all sequences lie one after another, `T` in total.

The FP8 KV cache (`ModelConfig.kv_cache_dtype` "fp8") is one uint8 tensor per layer,
`[2, num_pages, page_size, num_kv_heads * (head_dim + 4)]`: each cached token's row holds its heads'
e4m3 values, then one float32 scale per head (the vector's absolute maximum / 448, chosen when the token
is written). `fp8_kv_views` gives the values and the scales as tensors of their own dtypes. Rows stay
16-byte aligned for head_dim a multiple of 16.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from flare.models.quantization import E4M3_MAX, KV_SCALE_BYTES


@dataclass
class AttentionMetadata:
    """Where each sequence's new tokens sit in the flattened batch and where its context lives in the cache."""

    query_start_loc: torch.Tensor  # [B+1] int32: sequence b's new tokens are [query_start_loc[b], query_start_loc[b+1])
    seq_lens: torch.Tensor  # [B] int32: context length after this step (cached + new tokens)
    page_tables: torch.Tensor  # [B, max_pages] int32: the cache pages of each sequence, in order; the rest is padding
    slot_mapping: torch.Tensor  # [T] int64: page * page_size + offset where each new token's K/V is written
    max_query_len: int
    max_seq_len: int
    page_size: int
    # How many leading sequences bring exactly one new token, when longer chunks follow them (a mixed
    # step): kernels may serve those as decodes. 0 when there are none, or the batch is all decodes.
    num_decodes: int = 0
    # Host copies of query_start_loc and seq_lens, where the step had them anyway (int64): kernels that plan
    # on the host (flare.kernels.flashinfer_prefill) read them instead of copying the device tensors back.
    host_query_start: np.ndarray | None = None
    host_seq_lens: np.ndarray | None = None
    # [B, max_pages] int32: each sequence's window pages by block, for models whose cache has a "window" page
    # kind (flare.models.cache_spec); entries below a sequence's window are stale. None: no window pages.
    window_page_tables: torch.Tensor | None = None

    @classmethod
    def build(
        cls,
        query_lens: list[int],
        seq_lens: list[int],
        page_tables: list[list[int]],
        page_size: int,
        device: torch.device | str = "cpu",
        window_page_tables: list[list[int]] | None = None,
    ) -> AttentionMetadata:
        """From plain lists: each sequence's new-token count, its context length after the step, its pages,
        and (models with window pages) its window pages by block."""
        starts = [0]
        for length in query_lens:
            starts.append(starts[-1] + length)
        slots = []
        for query_len, seq_len, pages in zip(query_lens, seq_lens, page_tables, strict=True):
            slots += [pages[pos // page_size] * page_size + pos % page_size for pos in range(seq_len - query_len, seq_len)]
        width = max((len(pages) for pages in page_tables), default=0)
        padded = [pages + [0] * (width - len(pages)) for pages in page_tables]
        return cls(
            query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            page_tables=torch.tensor(padded, dtype=torch.int32, device=device).reshape(len(page_tables), width),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            max_query_len=max(query_lens, default=0),
            max_seq_len=max(seq_lens, default=0),
            page_size=page_size,
            num_decodes=leading_decodes(query_lens),
            host_query_start=np.array(starts, dtype=np.int64),
            host_seq_lens=np.array(seq_lens, dtype=np.int64),
            window_page_tables=None if window_page_tables is None else _padded_table(window_page_tables, device),
        )

    @property
    def num_tokens(self) -> int:
        return self.slot_mapping.shape[0]

    def token_sequence_index(self) -> torch.Tensor:
        """`[T]`: which sequence each new token belongs to."""
        tokens = torch.arange(self.num_tokens, device=self.query_start_loc.device, dtype=torch.int32)
        return torch.searchsorted(self.query_start_loc[1:], tokens, right=True)

    def token_seq_lens(self) -> torch.Tensor:
        """`[T]`: the context length after this step of each new token's sequence."""
        return self.seq_lens[self.token_sequence_index()]

    @property
    def uniform_query_len(self) -> int:
        """The number of new tokens every sequence brings when they all bring the same (0 when they differ)."""
        return uniform_query_len(self.num_tokens, self.seq_lens.shape[0], self.max_query_len)

    def positions(self) -> torch.Tensor:
        """`[T]` int64: the position of each new token in its sequence (new tokens come last in the context)."""
        sequence = self.token_sequence_index()
        tokens = torch.arange(self.num_tokens, device=sequence.device)
        from_end = self.query_start_loc[1:][sequence].to(torch.int64) - tokens
        return self.seq_lens[sequence].to(torch.int64) - from_end


def _padded_table(tables: list[list[int]], device) -> torch.Tensor:
    width = max((len(pages) for pages in tables), default=0)
    padded = [pages + [0] * (width - len(pages)) for pages in tables]
    return torch.tensor(padded, dtype=torch.int32, device=device).reshape(len(tables), width)


def uniform_query_len(num_tokens: int, num_seqs: int, max_query_len: int) -> int:
    """`max_query_len` when `num_tokens` new tokens over `num_seqs` sequences are that many each (no
    sequence brings more than the longest, so a total of longest times count leaves none shorter); else 0."""
    return max_query_len if num_seqs and num_tokens == max_query_len * num_seqs else 0


def leading_decodes(query_lens: list[int]) -> int:
    """AttentionMetadata.num_decodes of a batch: its leading one-token sequences, if longer ones follow."""
    count = 0
    while count < len(query_lens) and query_lens[count] == 1:
        count += 1
    return 0 if count == len(query_lens) else count


class AttentionBackend:
    """Computes attention for one layer over a flattened batch with a paged KV cache.

    `forward(query [T, Hq, D], key [T, Hkv, D], value [T, Hkv, D], kv_cache, meta, scale) -> [T, Hq, D]`:
    first write the new `key`/`value` into `kv_cache [2, num_pages, page_size, Hkv, D]` at
    `meta.slot_mapping`, then, for each sequence b, let its `q_len` new queries attend causally over its
    whole context of `meta.seq_lens[b]` tokens, read from the pages `meta.page_tables[b]`: query i sits
    at position `seq_lens[b] - q_len + i` and sees keys at positions up to and including its own.
    Query heads share KV heads in groups (`Hq // Hkv` consecutive query heads per KV head). Scores are
    multiplied by `scale`; the softmax runs in float32; the output has the query's dtype.

    `kernels` names the kernel family a model with attention of its own (DeepSeek V4) runs beside this
    backend: "torch" (references) or "triton".
    """

    kernels = "torch"

    def forward(self, query, key, value, kv_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        raise NotImplementedError


class TorchReferenceBackend(AttentionBackend):
    """Plain PyTorch, one sequence at a time: slow, obviously right, the yardstick for kernels."""

    def forward(self, query, key, value, kv_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        cache = kv_cache if kv_cache.dtype != torch.uint8 else fp8_kv_views(kv_cache, key.shape[1], key.shape[2])
        write_kv(cache, key, value, meta.slot_mapping)
        output = torch.empty_like(query)
        starts = meta.query_start_loc.tolist()
        for b, seq_len in enumerate(meta.seq_lens.tolist()):
            start, end = starts[b], starts[b + 1]
            keys, values = gather_context(cache, meta.page_tables[b], seq_len)
            output[start:end] = causal_attention(query[start:end], keys, values, scale)
        return output


@dataclass(frozen=True)
class Fp8KV:
    """Views of one layer's FP8 KV cache: e4m3 values `[num_pages, page_size, Hkv, D]` and float32 scales
    `[num_pages, page_size, Hkv]`, for keys and for values."""

    k: torch.Tensor
    v: torch.Tensor
    k_scale: torch.Tensor
    v_scale: torch.Tensor


def fp8_kv_views(kv_cache: torch.Tensor, num_kv_heads: int, head_dim: int) -> Fp8KV:
    """The values and scales inside a uint8 FP8 cache `[2, num_pages, page_size, Hkv * (D + 4)]`."""
    width = num_kv_heads * head_dim
    if kv_cache.dtype != torch.uint8 or kv_cache.shape[-1] != num_kv_heads * (head_dim + KV_SCALE_BYTES):
        raise ValueError(f"an FP8 KV cache for {num_kv_heads} heads of {head_dim} is uint8 [..., "
                         f"{num_kv_heads * (head_dim + KV_SCALE_BYTES)}]; got {kv_cache.dtype} {list(kv_cache.shape)}")
    values = kv_cache[..., :width].view(torch.float8_e4m3fn).unflatten(-1, (num_kv_heads, head_dim))
    scales = kv_cache[..., width:].view(torch.float32)
    return Fp8KV(values[0], values[1], scales[0], scales[1])


def quantize_kv(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x [..., D]` as e4m3 with one float32 scale per vector (its absolute maximum / 448; 1 for zeros)."""
    amax = x.float().abs().amax(dim=-1)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    return (x.float() / scale[..., None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn), scale


def write_kv(kv_cache: torch.Tensor | Fp8KV, key: torch.Tensor, value: torch.Tensor,
             slot_mapping: torch.Tensor) -> None:
    """Store each new token's K/V at its slot (`page * page_size + offset`); quantized for an FP8 cache."""
    if isinstance(kv_cache, Fp8KV):
        for values, scales, new in ((kv_cache.k, kv_cache.k_scale, key), (kv_cache.v, kv_cache.v_scale, value)):
            quantized, scale = quantize_kv(new)
            values.flatten(0, 1)[slot_mapping] = quantized
            scales.flatten(0, 1)[slot_mapping] = scale
        return
    _, num_pages, page_size, heads, head_dim = kv_cache.shape
    slots = kv_cache.view(2, num_pages * page_size, heads, head_dim)
    slots[0, slot_mapping] = key.to(kv_cache.dtype)
    slots[1, slot_mapping] = value.to(kv_cache.dtype)


def gather_context(kv_cache: torch.Tensor | Fp8KV, pages: torch.Tensor,
                   seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence's `seq_len` keys and values `[seq_len, Hkv, D]`, in position order (float32 from an
    FP8 cache: values times their scales)."""
    if isinstance(kv_cache, Fp8KV):
        page_size = kv_cache.k.shape[1]
        used = pages[: -(-seq_len // page_size)].long()
        return tuple((values[used].flatten(0, 1)[:seq_len].float()
                      * scales[used].flatten(0, 1)[:seq_len, :, None])
                     for values, scales in ((kv_cache.k, kv_cache.k_scale), (kv_cache.v, kv_cache.v_scale)))
    page_size = kv_cache.shape[2]
    used = pages[: -(-seq_len // page_size)].long()
    context = kv_cache[:, used].flatten(1, 2)[:, :seq_len]
    return context[0], context[1]


def causal_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """`query [q, Hq, D]` are the last q positions of a context `keys/values [s, Hkv, D]`; float32 inside."""
    q_len, num_heads, head_dim = query.shape
    seq_len, kv_heads, _ = keys.shape
    grouped = query.float().view(q_len, kv_heads, num_heads // kv_heads, head_dim)
    scores = torch.einsum("qhgd,shd->hgqs", grouped, keys.float()) * scale
    query_pos = torch.arange(seq_len - q_len, seq_len, device=query.device)[:, None]
    hidden = torch.arange(seq_len, device=query.device)[None, :] > query_pos
    probs = scores.masked_fill(hidden, float("-inf")).softmax(dim=-1)
    out = torch.einsum("hgqs,shd->qhgd", probs, values.float())
    return out.reshape(q_len, num_heads, head_dim).to(query.dtype)


def allocate_kv_caches(cfg, num_pages: int, page_size: int, dtype: torch.dtype, device) -> list[torch.Tensor]:
    """One zeroed cache per layer, `[2, num_pages, page_size, num_kv_heads, head_dim]` in `dtype`; for
    `cfg.kv_cache_dtype` "fp8" the uint8 FP8 cache described above (zero bytes: values 0, scales 0). A model
    with latent attention (`cfg.mla`) caches latent rows instead (flare.engine.mla_attention)."""
    if cfg.mla is not None:
        from flare.engine.mla_attention import allocate_latent_caches

        return allocate_latent_caches(cfg, num_pages, page_size, dtype, device)
    if cfg.kv_cache_dtype == "fp8":
        shape = (2, num_pages, page_size, cfg.num_key_value_heads * (cfg.head_dim + KV_SCALE_BYTES))
        dtype = torch.uint8
    else:
        shape = (2, num_pages, page_size, cfg.num_key_value_heads, cfg.head_dim)
    return [torch.zeros(shape, dtype=dtype, device=device) for _ in range(cfg.num_hidden_layers)]


def allocate_caches(cfg, num_pages: int, num_window_pages: int, page_size: int, dtype: torch.dtype, device) -> list:
    """Every layer's cache: the K/V tensor of `allocate_kv_caches`, or, for a model whose cache spec has more
    components (DeepSeek V4), a `flare.engine.layer_cache.LayerCache` of them (`num_window_pages` for the
    window kind)."""
    if cfg.v4 is None:
        return allocate_kv_caches(cfg, num_pages, page_size, dtype, device)
    from flare.engine.layer_cache import allocate_layer_caches
    from flare.models.cache_spec import cache_spec

    spec = cache_spec(cfg, page_size, torch.finfo(dtype).bits // 8)
    return allocate_layer_caches(spec, cfg.num_hidden_layers, num_pages, num_window_pages, dtype, device)


def kv_page_views(cfg, caches: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The caches `allocate_kv_caches(cfg, ...)` made, each as a view whose first dimension is the KV page
    (no copy): what the prefix cache's tiers move pages through (flare.engine.retention.host_pages). The
    K/V caches `[2, pages, ...]` are seen through movedim; latent caches are page-major already. A cache
    format added to allocate_kv_caches says here where its page dimension is; the tiers refuse views whose
    first dimension is not the allocator's page count."""
    if getattr(cfg, "v4", None) is not None:
        raise ValueError("the prefix cache's tiers move K/V and latent caches; a cache of several components "
                         "(DeepSeek V4's LayerCache) has no page-major view here")
    if cfg.mla is not None:
        return list(caches)                             # [pages, page_size, row]
    return [cache.movedim(1, 0) for cache in caches]
