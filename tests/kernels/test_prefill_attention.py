"""Prefill/extend attention over paged KV with a cached prefix, and the K/V cache write."""

from __future__ import annotations

import pytest
import torch

from paged_batch import TOLERANCE, tolerance, make_paged_batch, relative_error

# (cached prefix, new tokens) per sequence; pages of 16 tokens.
CASES = [
    ([(0, 5), (16, 17), (30, 1), (3, 20)], 4, 4, 64),    # fresh prompt, page-aligned prefix, decode row, ragged
    ([(0, 33), (40, 7)], 8, 2, 128),                     # GQA ratio 4, chunk crossing two pages
    ([(18, 20)], 2, 1, 96),                              # head_dim below its power-of-two tile
]


def run_prefill(batch):
    from flare.kernels.prefill_attention import prefill_attention, prefill_attention_reference

    out = torch.full_like(batch.q, float("nan"))
    prefill_attention(batch.q, batch.kv_cache[0], batch.kv_cache[1], batch.query_start_loc, batch.seq_lens,
                      batch.page_tables, batch.scale, max_query_len=batch.max_query_len, out=out)
    ref = prefill_attention_reference(batch.q.float(), batch.kv_cache[0].float(), batch.kv_cache[1].float(),
                                      batch.query_start_loc, batch.seq_lens, batch.page_tables, batch.scale)
    return out, ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("sequences,num_heads,num_kv_heads,head_dim", CASES)
def test_prefill_matches_reference(kernel_device, dtype, sequences, num_heads, num_kv_heads, head_dim):
    batch = make_paged_batch(sequences, num_heads, num_kv_heads, head_dim, page_size=16, dtype=dtype,
                             device=kernel_device)
    out, ref = run_prefill(batch)
    assert torch.isfinite(out).all()
    assert relative_error(out, ref) < tolerance(dtype, kernel_device)


def test_prefill_is_causal(kernel_device):
    """A token's output must not change when a later token of its chunk changes."""
    from flare.kernels.prefill_attention import prefill_attention

    batch = make_paged_batch([(5, 12)], 2, 2, 64, page_size=16, dtype=torch.float32, device=kernel_device)
    run = lambda: prefill_attention(batch.q, batch.kv_cache[0], batch.kv_cache[1], batch.query_start_loc,
                                    batch.seq_lens, batch.page_tables, batch.scale, max_query_len=12)
    before = run()
    last_slot = int(batch.slot_mapping[-1])
    batch.kv_cache[:, last_slot // 16, last_slot % 16] += 5.0
    after = run()
    torch.testing.assert_close(after[:-1], before[:-1])
    assert not torch.allclose(after[-1], before[-1])


def test_prefill_of_one_token_equals_decode(kernel_device):
    from flare.kernels.decode_attention import decode_attention
    from flare.kernels.prefill_attention import prefill_attention

    batch = make_paged_batch([(40, 1), (2, 1)], 8, 2, 64, page_size=16, dtype=torch.float32,
                             device=kernel_device)
    caches = (batch.kv_cache[0], batch.kv_cache[1])
    prefill = prefill_attention(batch.q, *caches, batch.query_start_loc, batch.seq_lens, batch.page_tables,
                                batch.scale, max_query_len=1)
    decode = decode_attention(batch.q, *caches, batch.page_tables, batch.seq_lens, batch.scale, num_splits=2)
    assert relative_error(prefill, decode) < tolerance(torch.float32, kernel_device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_write_kv_stores_at_slots_and_skips_padding(kernel_device, dtype):
    from flare.kernels.prefill_attention import write_kv, write_kv_reference

    cache = torch.randn(2, 6, 16, 2, 64).to(dtype).to(kernel_device)
    expected = cache.clone()
    k = torch.randn(5, 2, 64).to(dtype).to(kernel_device)
    v = torch.randn(5, 2, 64).to(dtype).to(kernel_device)
    slots = torch.tensor([3, 17, -1, 95, 40], dtype=torch.int64, device=kernel_device)
    write_kv(k, v, cache[0], cache[1], slots)
    write_kv_reference(k, v, expected[0], expected[1], slots)
    assert torch.equal(cache, expected)
    assert torch.equal(cache[0, 95 // 16, 95 % 16], k[3])
    assert torch.equal(cache[1, 17 // 16, 17 % 16], v[1])


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("sequences,num_heads,num_kv_heads,head_dim",
                         CASES + [([(0, 1000), (4000, 300), (100, 1)], 32, 8, 128)])
def test_prefill_matches_reference_bf16_on_gpu(sequences, num_heads, num_kv_heads, head_dim):
    batch = make_paged_batch(sequences, num_heads, num_kv_heads, head_dim, page_size=16,
                             dtype=torch.bfloat16, device="cuda")
    out, ref = run_prefill(batch)
    assert torch.isfinite(out).all()
    assert relative_error(out, ref) < TOLERANCE[torch.bfloat16]
