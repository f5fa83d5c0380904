"""DeepSeek V4's sparse attention (window plus compressed entries, with a sink) and its lightning indexer:
the Triton kernels against their torch references, on shuffled pages, at fp32 and fp16."""

from __future__ import annotations

import pytest
import torch

from flare.kernels.compressed_attention_reference import (indexer_scores_reference, indexer_topk_reference,
                                                          sparse_attention_reference)

PAGE = 16


def paged(rows_per_token_page: int, widths: int, lengths: list[int], rate: int, dtype, device, seed: int):
    """(cache [pages, rows, width], tables [B, blocks]) for sequences of `lengths` tokens, `rate` tokens a row,
    pages shuffled so no sequence's are contiguous."""
    generator = torch.Generator().manual_seed(seed)
    blocks = [-(-length // PAGE) for length in lengths]
    pages = torch.randperm(sum(blocks) + 3, generator=generator)
    cache = torch.randn(len(pages), PAGE // rate, widths, generator=generator).to(dtype).to(device)
    tables, used = torch.zeros(len(lengths), max(blocks), dtype=torch.int32), 0
    for b, count in enumerate(blocks):
        tables[b, :count] = pages[used:used + count]
        used += count
    return cache, tables.to(device)


def batch(lengths, new, heads, dim, dtype, device, seed=0):
    """The last `new[b]` positions of each sequence as query tokens."""
    seq = torch.cat([torch.full((n,), b) for b, n in enumerate(new)]).to(device)
    positions = torch.cat([torch.arange(length - n, length) for length, n in zip(lengths, new)]).to(device)
    generator = torch.Generator().manual_seed(seed + 1)
    query = (torch.randn(len(seq), heads, dim, generator=generator) / dim**0.25).to(dtype).to(device)
    return query, seq, positions


def tolerance(dtype):
    return 2e-5 if dtype == torch.float32 else 2e-2


CASES = [  # (sequence lengths, new tokens per sequence, heads, head_dim, window, rate)
    ([37, 5, 70], [1, 5, 13], 4, 32, 8, 4),
    ([129, 64], [3, 1], 20, 64, 16, 8),
]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("lengths,new,heads,dim,window,rate", CASES)
@pytest.mark.parametrize("mode", ["window", "entry ids", "entry counts"])
def test_sparse_attention_matches_its_reference(kernel_device, dtype, lengths, new, heads, dim, window, rate, mode):
    from flare.kernels.compressed_attention import sparse_attention

    window_kv, window_tables = paged(1, dim, lengths, 1, dtype, kernel_device, seed=1)
    entries, page_tables = paged(rate, dim, lengths, rate, dtype, kernel_device, seed=2)
    query, seq, positions = batch(lengths, new, heads, dim, dtype, kernel_device)
    sinks = torch.randn(heads, generator=torch.Generator().manual_seed(3)).to(kernel_device)
    visible = (positions + 1) // rate
    compressed = {}
    if mode == "entry ids":        # a few visible entries each, in any order, -1 padded
        ids = torch.full((len(seq), 5), -1, dtype=torch.int64)
        for t, count in enumerate(visible.tolist()):
            chosen = torch.randperm(count, generator=torch.Generator().manual_seed(t))[:4] if count else torch.empty(0)
            ids[t, :len(chosen)] = chosen
        compressed = {"entries": entries, "page_tables": page_tables, "entry_ids": ids.to(kernel_device)}
    elif mode == "entry counts":
        compressed = {"entries": entries, "page_tables": page_tables, "entry_counts": visible}
    scale = dim**-0.5
    out = sparse_attention(query, window_kv, window_tables, seq, positions, window, sinks, scale, **compressed)
    ref = sparse_attention_reference(query.float(), window_kv.float(), window_tables, seq, positions, window, sinks,
                                     scale, **{k: v.float() if k == "entries" else v for k, v in compressed.items()})
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.float(), ref, rtol=tolerance(dtype), atol=tolerance(dtype))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_indexer_scores_and_choice_match_the_reference(kernel_device, dtype):
    from flare.kernels.compressed_attention import indexer_scores, indexer_topk

    lengths, new, heads, dim, rate = [70, 37, 9], [13, 1, 4], 18, 32, 4
    keys, tables = paged(rate, dim, lengths, rate, dtype, kernel_device, seed=4)
    query, seq, positions = batch(lengths, new, heads, dim, dtype, kernel_device, seed=5)
    weights = torch.randn(len(seq), heads, generator=torch.Generator().manual_seed(6)).to(kernel_device)
    visible = (positions + 1) // rate
    scale = dim**-0.5
    scores = indexer_scores(query, weights, keys, tables, seq, visible, scale, int(visible.max()))
    ref = indexer_scores_reference(query.float(), weights, keys.float(), tables, seq, visible, scale)
    torch.testing.assert_close(scores, ref, rtol=tolerance(dtype), atol=tolerance(dtype))
    if dtype == torch.float32:     # scores that agree this closely choose the same entries
        chosen = indexer_topk(query, weights, keys, tables, seq, visible, scale, 5)
        assert torch.equal(chosen, indexer_topk_reference(query, weights, keys, tables, seq, visible, scale, 5))


def test_sparse_attention_reads_only_its_own_window_and_entries(kernel_device):
    from flare.kernels.compressed_attention import sparse_attention

    lengths, new = [40, 20], [2, 1]
    window_kv, window_tables = paged(1, 32, lengths, 1, torch.float32, kernel_device, seed=7)
    entries, page_tables = paged(4, 32, lengths, 4, torch.float32, kernel_device, seed=8)
    query, seq, positions = batch(lengths, new, 4, 32, torch.float32, kernel_device)
    sinks = torch.zeros(4, device=kernel_device)
    args = (query, window_kv, window_tables, seq, positions, 8, sinks, 32**-0.5)
    compressed = {"entries": entries, "page_tables": page_tables, "entry_counts": (positions + 1) // 4}
    before = sparse_attention(*args, **compressed)
    # window rows before each token's window, and entries past what it may see, are written over
    for b, length in enumerate(lengths):
        for position in range(length - 8 - 2):
            window_kv[window_tables[b, position // PAGE], position % PAGE] = 1e4
        for entry in range(length // 4, PAGE * window_tables.shape[1] // 4):
            entries[page_tables[b, entry // 4], entry % 4] = 1e4
    torch.testing.assert_close(sparse_attention(*args, **compressed), before)
