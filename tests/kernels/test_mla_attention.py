"""Latent attention (MLA, absorbed form) over a paged latent cache: the Triton decode and prefill kernels and
the backend that dispatches them, against their torch references."""

from __future__ import annotations

import pytest
import torch

from paged_batch import make_paged_batch, relative_error, tolerance

RANK, ROPE = 32, 16                       # tiny latent and rotary widths; real models: 512 and 64


def latent_batch(prefix_and_query_lens, num_heads, dtype, device, seed=0, rank=RANK, rope=ROPE):
    """A paged batch whose cache is one latent row per token ([pages, page_size, rank + rope])."""
    batch = make_paged_batch(prefix_and_query_lens, num_heads, 1, rank + rope, page_size=16, dtype=dtype,
                             device=device, seed=seed)
    return batch, batch.kv_cache[0, :, :, 0].contiguous()


def quantized(cache, rank=RANK):
    """The FP8 latent cache of `cache`'s rows: e4m3 values and their two float32 scales."""
    from flare.kernels.mla_reference import quantize_latent_rows

    values, scales = quantize_latent_rows(cache.float().flatten(0, 1), rank)
    return values.view(cache.shape), scales.view(*cache.shape[:2], 2)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("num_heads,num_splits", [(4, 1), (4, 3), (20, 2)])
def test_decode_matches_reference(kernel_device, dtype, num_heads, num_splits):
    from flare.kernels.mla_decode import mla_decode, mla_decode_reference

    batch, cache = latent_batch([(0, 1), (15, 1), (16, 1), (44, 1)], num_heads, dtype, kernel_device)
    out = torch.full((4, num_heads, RANK), float("nan"), dtype=dtype, device=kernel_device)
    mla_decode(batch.q, cache, batch.page_tables, batch.seq_lens, batch.scale, RANK, num_splits, out)
    ref = mla_decode_reference(batch.q.float(), cache.float(), batch.page_tables, batch.seq_lens, batch.scale, RANK)
    assert torch.isfinite(out).all()
    assert relative_error(out, ref) < tolerance(dtype, kernel_device)


def test_decode_of_an_empty_padding_row_is_zero(kernel_device):
    from flare.kernels.mla_decode import mla_decode

    batch, cache = latent_batch([(20, 1), (3, 1)], 4, torch.float32, kernel_device)
    seq_lens = batch.seq_lens.clone()
    seq_lens[1] = 0
    out = mla_decode(batch.q, cache, batch.page_tables, seq_lens, batch.scale, RANK, 2)
    assert torch.equal(out[1], torch.zeros_like(out[1]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("lengths", [[(0, 23)], [(37, 5), (0, 1), (16, 17)], [(5, 3), (9, 3)]])
def test_prefill_matches_reference(kernel_device, dtype, lengths):
    from flare.kernels.mla_prefill import mla_prefill, mla_prefill_reference

    batch, cache = latent_batch(lengths, 4, dtype, kernel_device, seed=1)
    out = torch.full((batch.q.shape[0], 4, RANK), float("nan"), dtype=dtype, device=kernel_device)
    mla_prefill(batch.q, cache, batch.query_start_loc, batch.seq_lens, batch.page_tables, batch.scale, RANK,
                batch.max_query_len, out)
    ref = mla_prefill_reference(batch.q.float(), cache.float(), batch.query_start_loc, batch.seq_lens,
                                batch.page_tables, batch.scale, RANK)
    assert torch.isfinite(out).all()
    assert relative_error(out, ref) < tolerance(dtype, kernel_device)


def test_prefill_leaves_the_rows_before_first_seq_alone(kernel_device):
    from flare.kernels.mla_prefill import mla_prefill, mla_prefill_reference

    batch, cache = latent_batch([(10, 1), (4, 9)], 4, torch.float32, kernel_device)
    out = torch.full((10, 4, RANK), 7.0, device=kernel_device)
    mla_prefill(batch.q, cache, batch.query_start_loc, batch.seq_lens, batch.page_tables, batch.scale, RANK,
                batch.max_query_len, out, first_seq=1)
    ref = mla_prefill_reference(batch.q, cache, batch.query_start_loc, batch.seq_lens, batch.page_tables,
                                batch.scale, RANK)
    assert torch.equal(out[0], torch.full_like(out[0], 7.0))
    assert relative_error(out[1:], ref[1:]) < tolerance(torch.float32, kernel_device)


@pytest.mark.parametrize("kernel", ["decode", "prefill"])
def test_fp8_cache_matches_reference_over_the_same_fp8_rows(kernel_device, kernel):
    """Over an FP8 cache the kernels read e4m3 rows times their scales, as the reference dequantizes them."""
    from flare.kernels.mla_decode import mla_decode, mla_decode_reference
    from flare.kernels.mla_prefill import mla_prefill, mla_prefill_reference

    lengths = [(20, 1), (33, 1)] if kernel == "decode" else [(20, 4), (0, 9)]
    batch, cache = latent_batch(lengths, 4, torch.float16, kernel_device, seed=2)
    values, scales = quantized(cache)
    if kernel == "decode":
        out = mla_decode(batch.q, values, batch.page_tables, batch.seq_lens, batch.scale, RANK, 2, scales=scales)
        ref = mla_decode_reference(batch.q.float(), values, batch.page_tables, batch.seq_lens, batch.scale, RANK,
                                   scales=scales)
    else:
        args = (batch.query_start_loc, batch.seq_lens, batch.page_tables, batch.scale, RANK)
        out = mla_prefill(batch.q, values, *args, batch.max_query_len, scales=scales)
        ref = mla_prefill_reference(batch.q.float(), values, *args, scales=scales)
    assert relative_error(out, ref) < 5e-3                    # fp16 products of the e4m3 values


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "fp8"])
def test_backend_mixed_step_matches_the_reference_backend(kernel_device, kv_cache_dtype):
    """Two decodes beside a prompt chunk over a cached prefix: the Triton backend writes the new rows and
    attends as the torch reference backend does, on caches of either dtype."""
    from flare.engine.attention import AttentionMetadata
    from flare.engine.mla_attention import MlaReferenceBackend, latent_cache_shape
    from flare.engine.mla_attention_triton import MlaTritonBackend

    generator = torch.Generator().manual_seed(3)
    query_lens, seq_lens = [1, 1, 6], [18, 5, 26]
    tables = [[4, 9], [2], [7, 0]]
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, 16, device=kernel_device)
    fp8 = kv_cache_dtype == "fp8"
    base = torch.randn(latent_cache_shape(12, 16, RANK + ROPE, False), generator=generator)
    if fp8:
        values, scales = quantized(base.half())
        base = torch.cat([values.view(torch.uint8), scales.view(torch.uint8)], dim=-1)
    else:
        base = base.half()
    query = torch.randn(8, 4, RANK + ROPE, generator=generator).half().to(kernel_device)
    key = torch.randn(8, 1, RANK + ROPE, generator=generator).half().to(kernel_device)
    outs = []
    for backend in (MlaTritonBackend(), MlaReferenceBackend()):
        cache = base.clone().to(kernel_device)
        outs.append((backend.forward(query, key, key[..., :RANK], cache, meta, 0.2).float(), cache))
    (ours, our_cache), (ref, ref_cache) = outs
    assert torch.equal(our_cache, ref_cache)
    assert relative_error(ours, ref) < 5e-3
