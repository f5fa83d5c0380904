"""The attention metadata and the reference backend keep the documented contract."""

from __future__ import annotations

import torch

from flare.engine.attention import AttentionMetadata, TorchReferenceBackend


def test_build_lays_out_two_sequences_as_documented():
    # a: 3 cached + 2 new tokens in pages [5, 2]; b: a fresh 3-token prompt in page [7]; pages of 4 slots
    meta = AttentionMetadata.build(query_lens=[2, 3], seq_lens=[5, 3], page_tables=[[5, 2], [7]], page_size=4)
    assert meta.query_start_loc.tolist() == [0, 2, 5] and meta.query_start_loc.dtype == torch.int32
    assert meta.seq_lens.tolist() == [5, 3] and meta.seq_lens.dtype == torch.int32
    assert meta.page_tables.tolist() == [[5, 2], [7, 0]] and meta.page_tables.dtype == torch.int32
    assert meta.slot_mapping.tolist() == [5 * 4 + 3, 2 * 4 + 0, 28, 29, 30]
    assert meta.slot_mapping.dtype == torch.int64
    assert (meta.max_query_len, meta.max_seq_len, meta.page_size) == (3, 5, 4)
    assert meta.positions().tolist() == [3, 4, 0, 1, 2]
    assert meta.token_seq_lens().tolist() == [5, 5, 3, 3, 3]


def dense_causal_attention(q, k, v, scale):
    """Textbook attention over one whole sequence, each query head reading KV head `head // group`."""
    group = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(group, dim=1), v.repeat_interleave(group, dim=1)
    scores = torch.einsum("qhd,khd->hqk", q, k) * scale
    scores = scores + torch.full(scores.shape[1:], float("-inf")).triu(1)
    return torch.einsum("hqk,khd->qhd", scores.softmax(-1), v)


def test_reference_backend_writes_the_cache_and_attends_over_cached_and_new_tokens():
    torch.manual_seed(0)
    heads, kv_heads, dim, page_size, length, cached = 4, 2, 8, 4, 11, 6
    q, k, v = torch.randn(length, heads, dim), torch.randn(length, kv_heads, dim), torch.randn(length, kv_heads, dim)
    kv_cache = torch.zeros(2, 6, page_size, kv_heads, dim)
    pages = [4, 1, 3]
    backend = TorchReferenceBackend()
    first = AttentionMetadata.build([cached], [cached], [pages[:2]], page_size)
    backend.forward(q[:cached], k[:cached], v[:cached], kv_cache, first, 0.5)
    second = AttentionMetadata.build([length - cached], [length], [pages], page_size)
    out = backend.forward(q[cached:], k[cached:], v[cached:], kv_cache, second, 0.5)

    torch.testing.assert_close(out, dense_causal_attention(q, k, v, 0.5)[cached:])
    torch.testing.assert_close(kv_cache[0, 1, 2], k[6])  # position 6 lives in the second page, slot 2
    torch.testing.assert_close(kv_cache[1, 3, 2], v[10])
