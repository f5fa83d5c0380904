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
    ([4, 4, 4], [0, 30, 16]),         # four new tokens each (one of them a whole prompt): multi-query
    ([9, 9], [20, 100]),              # a token and eight drafts each: multi-query, 36 rows a tile
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
    given = torch.full_like(query, float("nan"))              # the caller's buffer takes every row
    returned = triton_backend.attend(query, key, value, ours_cache, meta, head_dim ** -0.5, out=given)
    assert returned.data_ptr() == given.data_ptr()
    assert torch.equal(given, out)


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


def kernel_taken(monkeypatch, query_lens, cached, device) -> str:
    """Which kernel module's entry point the Triton backend called for a batch (the calls go through)."""
    import flare.kernels.decode_attention as decode
    import flare.kernels.flash_prefill as flash
    import flare.kernels.multi_query_attention as multi_query
    from flare.engine.attention import AttentionMetadata
    from flare.engine.attention_triton import TritonBackend

    taken = []
    for module, name in ((decode, "decode_attention"), (flash, "flash_prefill_attention"),
                         (multi_query, "multi_query_attention")):
        def recorded(*args, _real=getattr(module, name), _name=name, **kwargs):
            taken.append(_name)
            return _real(*args, **kwargs)
        monkeypatch.setattr(module, name, recorded)
    seq_lens = [c + q for c, q in zip(cached, query_lens)]
    tables = [[b * 8 + i for i in range(-(-length // 16))] for b, length in enumerate(seq_lens)]
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, 16, device=device)
    tokens = sum(query_lens)
    cache = torch.zeros(2, 8 * len(query_lens), 16, 2, 16, device=device)
    query, key, value = (torch.randn(tokens, heads, 16, device=device) for heads in (4, 2, 2))
    TritonBackend().forward(query, key, value, cache, meta, 0.25)
    return "+".join(taken)


@pytest.mark.parametrize("query_lens,cached,kernel", [
    ([1, 1], [5, 30], "decode_attention"),
    ([2, 2, 2], [5, 30, 0], "multi_query_attention"),              # a token and one draft each
    ([16, 16], [5, 30], "multi_query_attention"),                  # MAX_QUERY_TOKENS each
    ([17, 17], [5, 30], "flash_prefill_attention"),                # past it: prompt chunks
    ([4, 3, 4], [5, 30, 9], "flash_prefill_attention"),            # uneven counts
    ([1, 4], [5, 30], "decode_attention+flash_prefill_attention"),  # a decode beside a chunk: a mixed step
])
def test_the_backend_takes_multi_query_attention_when_every_sequence_brings_the_same_few_tokens(
        kernel_device, monkeypatch, query_lens, cached, kernel):
    from flare.kernels.multi_query_attention import MAX_QUERY_TOKENS

    assert MAX_QUERY_TOKENS == 16
    assert kernel_taken(monkeypatch, query_lens, cached, kernel_device) == kernel


def test_the_metadata_says_when_every_sequence_brings_the_same_number_of_tokens():
    from flare.engine.attention import AttentionMetadata

    def uniform(query_lens):
        return AttentionMetadata.build(query_lens, [q + 3 for q in query_lens], [[0]] * len(query_lens),
                                       16).uniform_query_len

    assert [uniform([3, 3, 3]), uniform([1, 1]), uniform([3, 2, 3]), uniform([2, 3]), uniform([])] == [3, 1, 0, 0, 0]
