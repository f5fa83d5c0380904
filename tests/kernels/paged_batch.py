"""Random paged-KV batches for the kernel tests: pages scattered at random through the cache."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class PagedBatch:
    q: torch.Tensor                 # [T, Hq, D]
    kv_cache: torch.Tensor          # [2, num_pages, page_size, Hkv, D]
    query_start_loc: torch.Tensor   # [B + 1] int32
    seq_lens: torch.Tensor          # [B] int32
    page_tables: torch.Tensor      # [B, max_pages] int32
    slot_mapping: torch.Tensor      # [T] int64, where each new token's K/V belong
    scale: float

    @property
    def max_query_len(self) -> int:
        return int((self.query_start_loc[1:] - self.query_start_loc[:-1]).max())


def make_paged_batch(prefix_and_query_lens, num_heads, num_kv_heads, head_dim, page_size, dtype,
                     device, seed=0) -> PagedBatch:
    """Sequences given as (cached prefix length, new tokens); the cache holds random K/V for every page
    (prefix and new slots alike), spare pages included, so stray reads change the result."""
    generator = torch.Generator().manual_seed(seed)
    pages_per_seq = [-(-(prefix + new) // page_size) for prefix, new in prefix_and_query_lens]
    num_pages = sum(pages_per_seq) + 3
    order = torch.randperm(num_pages, generator=generator)
    max_pages = max(pages_per_seq) + 1
    page_tables = torch.full((len(pages_per_seq), max_pages), num_pages - 1, dtype=torch.int32)
    slots, taken = [], 0
    for seq, ((prefix, new), count) in enumerate(zip(prefix_and_query_lens, pages_per_seq)):
        page_tables[seq, :count] = order[taken:taken + count].int()
        taken += count
        for position in range(prefix, prefix + new):
            slots.append(int(page_tables[seq, position // page_size]) * page_size + position % page_size)
    query_lens = [new for _, new in prefix_and_query_lens]
    query_start_loc = torch.tensor([0] + query_lens, dtype=torch.int32).cumsum(0).int()
    seq_lens = torch.tensor([prefix + new for prefix, new in prefix_and_query_lens], dtype=torch.int32)
    kv = torch.randn(2, num_pages, page_size, num_kv_heads, head_dim, generator=generator)
    q = torch.randn(sum(query_lens), num_heads, head_dim, generator=generator)
    return PagedBatch(q=q.to(dtype).to(device), kv_cache=kv.to(dtype).to(device),
                      query_start_loc=query_start_loc.to(device), seq_lens=seq_lens.to(device),
                      page_tables=page_tables.to(device),
                      slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
                      scale=head_dim ** -0.5)


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm())


TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
TF32_TOLERANCE = 2e-3      # on a GPU a float32 tl.dot rounds its inputs to tf32


def tolerance(dtype: torch.dtype, device) -> float:
    on_gpu = torch.device(device).type == "cuda"
    return TF32_TOLERANCE if dtype == torch.float32 and on_gpu else TOLERANCE[dtype]
