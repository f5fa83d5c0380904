"""The FP8 KV cache: its write kernel and the decode and prefill kernels reading it, against the torch
reference, in the cache's real byte layout (e4m3 values and float32 scales in one uint8 row per token)."""

from __future__ import annotations

import pytest
import torch

from paged_batch import make_paged_batch, relative_error, tolerance


def fp8_cache_of(dense: torch.Tensor):
    """The uint8 FP8 cache holding `dense` [2, pages, page_size, Hkv, D] quantized, and its views."""
    from flare.engine.attention import fp8_kv_views, quantize_kv

    _, pages, page_size, heads, head_dim = dense.shape
    cache = torch.zeros(2, pages, page_size, heads * (head_dim + 4), dtype=torch.uint8, device=dense.device)
    views = fp8_kv_views(cache, heads, head_dim)
    for values, scales, part in ((views.k, views.k_scale, dense[0]), (views.v, views.v_scale, dense[1])):
        quantized, scale = quantize_kv(part)
        values.copy_(quantized)
        scales.copy_(scale)
    return cache, views


def scales(views) -> dict:
    return {"k_scale": views.k_scale, "v_scale": views.v_scale}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("context_lens,num_heads,num_kv_heads,head_dim", [
    ([1, 17, 45], 4, 4, 64),
    ([33, 5], 8, 2, 96),                # GQA 4, head_dim below its power-of-two tile
])
@pytest.mark.parametrize("num_splits", [1, 3])
@pytest.mark.parametrize("fp16_math", [True, False])
def test_decode_over_an_fp8_cache_matches_reference(kernel_device, dtype, context_lens, num_heads, num_kv_heads,
                                                    head_dim, num_splits, fp16_math):
    from flare.kernels.decode_attention import decode_attention, decode_attention_reference

    batch = make_paged_batch([(length - 1, 1) for length in context_lens], num_heads, num_kv_heads, head_dim,
                             page_size=16, dtype=dtype, device=kernel_device)
    _, views = fp8_cache_of(batch.kv_cache.float())
    out = torch.full_like(batch.q, float("nan"))
    decode_attention(batch.q, views.k, views.v, batch.page_tables, batch.seq_lens, batch.scale, num_splits,
                     out=out, fp16_math=fp16_math, **scales(views))
    ref = decode_attention_reference(batch.q.float(), views.k, views.v, batch.page_tables, batch.seq_lens,
                                     batch.scale, **scales(views))
    assert torch.isfinite(out).all()
    # fp16 products: q and the dequantized V rounded to fp16 whatever q's dtype
    assert relative_error(out, ref) < tolerance(torch.float16 if fp16_math else dtype, kernel_device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_prefill_over_an_fp8_cache_matches_reference(kernel_device, dtype):
    from flare.kernels.prefill_attention import prefill_attention, prefill_attention_reference

    # a prompt, an extend over a cached prefix, a one-token row
    batch = make_paged_batch([(0, 21), (18, 9), (30, 1)], 8, 2, 64, page_size=16, dtype=dtype,
                             device=kernel_device)
    _, views = fp8_cache_of(batch.kv_cache.float())
    args = (batch.query_start_loc, batch.seq_lens, batch.page_tables, batch.scale)
    out = prefill_attention(batch.q, views.k, views.v, *args, max_query_len=batch.max_query_len, **scales(views))
    ref = prefill_attention_reference(batch.q.float(), views.k, views.v, *args, **scales(views))
    assert relative_error(out, ref) < tolerance(dtype, kernel_device)


def test_the_write_kernel_quantizes_each_head_vector_to_its_own_scale(kernel_device):
    """Scales are each vector's absolute maximum / 448, values torch's e4m3 of value / scale. Under the
    interpreter only: its float8 conversion does not carry a rounding into the next power of two (GPU
    Triton rounds to nearest even like torch), so a value torch rounds up to 2^n may come back as 2^(n-1)."""
    from flare.engine.attention import quantize_kv
    from flare.kernels.prefill_attention import write_kv_fp8

    generator = torch.Generator().manual_seed(2)
    _, views = fp8_cache_of(torch.zeros(2, 4, 16, 2, 64).to(kernel_device))
    magnitudes = torch.tensor([1e-3, 1.0, 40.0])[:, None, None]      # scales far apart: per-vector scales hold
    key = (torch.randn(3, 2, 64, generator=generator) * magnitudes).to(kernel_device)
    value = (torch.randn(3, 2, 64, generator=generator) * magnitudes).to(kernel_device)
    slots = torch.tensor([5, -1, 37], dtype=torch.int64, device=kernel_device)
    write_kv_fp8(key, value, views.k, views.v, views.k_scale, views.v_scale, slots)
    interpreted = kernel_device == "cpu"
    for values, scale, new in ((views.k, views.k_scale, key), (views.v, views.v_scale, value)):
        expected_values, expected_scales = quantize_kv(new[[0, 2]])
        torch.testing.assert_close(scale.flatten(0, 1)[[5, 37]], expected_scales)
        stored, expected = values.flatten(0, 1)[[5, 37]].float(), expected_values.float()
        differs = stored != expected
        carried = (expected.abs().log2() % 1 == 0) & (stored == expected / 2)
        assert not (differs & ~(carried if interpreted else torch.zeros_like(carried))).any()
        assert differs.float().mean() < 0.05
        others = [slot for slot in range(values.flatten(0, 1).shape[0]) if slot not in (5, 37)]
        assert (values.flatten(0, 1)[others].float() == 0).all()    # the padding token wrote nothing


@pytest.mark.parametrize("query_lens,cached", [([7, 1, 20], [0, 30, 16]), ([1, 1, 1], [0, 15, 40]),
                                               ([1, 1, 7], [15, 40, 0]), ([3, 3], [30, 5])])
def test_triton_backend_with_an_fp8_cache_matches_the_reference_backend(kernel_device, query_lens, cached):
    from flare.engine.attention import AttentionMetadata, TorchReferenceBackend
    from flare.engine.attention_triton import TritonBackend

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
    cache, _ = fp8_cache_of(torch.randn(2, len(order), page_size, kv_heads, head_dim, generator=generator)
                            .to(kernel_device))
    tokens = sum(query_lens)
    query = torch.randn(tokens, heads, head_dim, generator=generator).half().to(kernel_device)
    key, value = (exactly_quantizable(tokens, kv_heads, head_dim, generator).to(kernel_device) for _ in range(2))
    ours, theirs = cache.clone(), cache.clone()
    out = TritonBackend().forward(query, key, value, ours, meta, head_dim ** -0.5)
    ref = TorchReferenceBackend().forward(query.float(), key.float(), value.float(), theirs, meta, head_dim ** -0.5)
    assert out.dtype == torch.float16
    assert torch.equal(ours, theirs)                   # the same bytes written, the rest untouched
    assert relative_error(out, ref) < tolerance(torch.float16, kernel_device)


def exactly_quantizable(tokens, heads, head_dim, generator):
    """New K/V whose e4m3 quantization rounds nothing: e4m3 values with a largest element of 448, times a
    power of two (so the kernel's and torch's roundings cannot differ, see the write kernel's test)."""
    values = (torch.randn(tokens, heads, head_dim, generator=generator) * 100).to(torch.float8_e4m3fn).float()
    values[..., 0] = 448.0
    return (values * 2.0 ** -6).half()


def test_an_fp8_cache_stays_close_to_the_dense_one():
    """Attention through the reference backend with an FP8 cache differs from the float32 cache by little."""
    from flare.engine.attention import AttentionMetadata, TorchReferenceBackend

    generator = torch.Generator().manual_seed(5)
    meta = AttentionMetadata.build([12, 1], [12, 30], [[0], [1, 2]], 16)
    dense = torch.zeros(2, 3, 16, 2, 32)
    fp8, _ = fp8_cache_of(dense)
    query, key, value = (torch.randn(13, h, 32, generator=generator) for h in (4, 2, 2))
    backend = TorchReferenceBackend()
    exact = backend.forward(query, key, value, dense, meta, 32 ** -0.5)
    approximate = backend.forward(query, key, value, fp8, meta, 32 ** -0.5)
    assert 0 < relative_error(approximate, exact) < 0.05


def test_scales_must_come_with_an_fp8_cache(kernel_device):
    from flare.kernels.decode_attention import decode_attention

    batch = make_paged_batch([(3, 1)], 4, 2, 64, page_size=16, dtype=torch.float32, device=kernel_device)
    _, views = fp8_cache_of(batch.kv_cache)
    with pytest.raises(ValueError, match="dtypes differ"):
        decode_attention(batch.q, views.k, views.v, batch.page_tables, batch.seq_lens, batch.scale, 1)
    with pytest.raises(ValueError, match="k_scale must be float32"):
        decode_attention(batch.q, views.k, views.v, batch.page_tables, batch.seq_lens, batch.scale, 1,
                         k_scale=views.k_scale[:1], v_scale=views.v_scale)
