"""TritonBackend keeps the AttentionBackend contract: same cache writes and outputs as the reference."""

from __future__ import annotations

import pytest
import torch

from paged_batch import tolerance, relative_error


def backends():
    from flare.engine.attention import TorchReferenceBackend
    from flare.engine.attention_triton import TritonBackend

    return TritonBackend(), TorchReferenceBackend()


@pytest.mark.parametrize("query_lens,cached", [
    ([7, 1, 20], [0, 30, 16]),        # prefill, decode row and extend over a cached prefix in one batch
    ([1, 1, 1], [0, 15, 40]),         # pure decode: the split-K path
    ([1, 1, 7, 20], [15, 40, 0, 16]), # decodes first, then chunks: decode kernel for two, prefill for the rest
])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_triton_backend_matches_the_reference_backend(kernel_device, query_lens, cached, dtype):
    from flare.engine.attention import AttentionMetadata

    generator = torch.Generator().manual_seed(3)
    page_size, heads, kv_heads, head_dim = 16, 8, 2, 64
    seq_lens = [c + q for c, q in zip(cached, query_lens)]
    pages_needed = [-(-length // page_size) for length in seq_lens]
    order = torch.randperm(sum(pages_needed) + 2, generator=generator).tolist()
    tables, taken = [], 0
    for count in pages_needed:
        tables.append(order[taken:taken + count])
        taken += count
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, page_size, device=kernel_device)
    assert meta.num_decodes == (2 if query_lens[:2] == [1, 1] and len(set(query_lens)) > 1 else 0)
    cache = torch.randn(2, len(order), page_size, kv_heads, head_dim, generator=generator).to(dtype)
    tokens = sum(query_lens)
    query = torch.randn(tokens, heads, head_dim, generator=generator).to(dtype).to(kernel_device)
    key = torch.randn(tokens, kv_heads, head_dim, generator=generator).to(dtype).to(kernel_device)
    value = torch.randn(tokens, kv_heads, head_dim, generator=generator).to(dtype).to(kernel_device)
    triton_backend, reference = backends()
    ours_cache, ref_cache = cache.clone().to(kernel_device), cache.clone().float().to(kernel_device)

    out = triton_backend.forward(query, key, value, ours_cache, meta, head_dim ** -0.5)
    ref = reference.forward(query.float(), key.float(), value.float(), ref_cache, meta, head_dim ** -0.5)
    assert out.dtype == dtype and out.shape == query.shape
    assert torch.equal(ours_cache.float(), ref_cache)          # the same slots written, the rest untouched
    assert relative_error(out, ref) < tolerance(dtype, kernel_device)


def test_compiled_model_code_traces_through_the_attention_op(kernel_device):
    """torch.compile sees one custom operator (no graph break) and gets the eager result."""
    from flare.engine.attention import AttentionMetadata
    from flare.engine.attention_triton import TritonBackend

    generator = torch.Generator().manual_seed(4)
    meta = AttentionMetadata.build([1, 1], [9, 30], [[2, 0], [1, 3]], 16, device=kernel_device)
    cache = torch.randn(2, 4, 16, 2, 64, generator=generator).to(kernel_device)
    query = torch.randn(2, 4, 64, generator=generator).to(kernel_device)
    key = torch.randn(2, 2, 64, generator=generator).to(kernel_device)
    value = torch.randn(2, 2, 64, generator=generator).to(kernel_device)
    backend = TritonBackend(decode_splits=2)

    def layer(q, k, v, c):
        return backend.forward(q * 2, k, v, c, meta, 0.125) + 1

    eager_cache = cache.clone()
    expected = layer(query, key, value, eager_cache)
    compiled = torch.compile(layer, backend="aot_eager", fullgraph=True)
    compiled_cache = cache.clone()
    torch.testing.assert_close(compiled(query, key, value, compiled_cache), expected)
    assert torch.equal(compiled_cache, eager_cache)              # the K/V write happened under compile too
