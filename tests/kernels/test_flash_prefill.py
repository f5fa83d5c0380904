"""The Hopper prefill kernel (flash_prefill) computes prefill_attention's function: against the torch
reference over the bf16/fp16/fp32 cache and the FP8 cache, at several tile shapes (key tiles within one
page and across pages, diagonal tiles), with decode rows left to another kernel (first_seq)."""

from __future__ import annotations

import pytest
import torch

from paged_batch import make_paged_batch, relative_error, tolerance
from test_fp8_kv_cache import fp8_cache_of, scales

CASES = [
    ([(0, 5), (16, 17), (30, 1), (3, 20)], 4, 4, 64),    # fresh prompt, page-aligned prefix, decode row, ragged
    ([(0, 70), (40, 7)], 8, 2, 128),                     # GQA ratio 4, a chunk over several query tiles
    ([(18, 20)], 2, 1, 96),                              # head_dim below its power-of-two tile
    ([(37, 45)], 4, 2, 64),                              # extend: prefix tiles unmasked, then the diagonal
]


def configs():
    from flare.kernels.flash_prefill import FlashConfig

    return [None, FlashConfig(block_m=32, block_n=32), FlashConfig(block_m=16, block_n=64),
            FlashConfig(block_m=32, block_n=16)]


def reference(batch, **fp8):
    from flare.kernels.prefill_attention import prefill_attention_reference

    caches = (fp8.pop("k"), fp8.pop("v")) if fp8 else (batch.kv_cache[0].float(), batch.kv_cache[1].float())
    return prefill_attention_reference(batch.q.float(), *caches, batch.query_start_loc, batch.seq_lens,
                                       batch.page_tables, batch.scale, **fp8)


@pytest.mark.parametrize("config", range(4))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("sequences,num_heads,num_kv_heads,head_dim", CASES)
def test_flash_prefill_matches_reference(kernel_device, dtype, sequences, num_heads, num_kv_heads, head_dim,
                                         config):
    from flare.kernels.flash_prefill import flash_prefill_attention

    batch = make_paged_batch(sequences, num_heads, num_kv_heads, head_dim, page_size=16, dtype=dtype,
                             device=kernel_device)
    out = torch.full_like(batch.q, float("nan"))
    flash_prefill_attention(batch.q, batch.kv_cache[0], batch.kv_cache[1], batch.query_start_loc, batch.seq_lens,
                            batch.page_tables, batch.scale, max_query_len=batch.max_query_len, out=out,
                            config=configs()[config])
    assert torch.isfinite(out).all()
    assert relative_error(out, reference(batch)) < tolerance(dtype, kernel_device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_flash_prefill_over_an_fp8_cache_matches_reference(kernel_device, dtype):
    from flare.kernels.flash_prefill import flash_prefill_attention

    batch = make_paged_batch([(0, 21), (18, 9), (30, 1), (5, 40)], 8, 2, 64, page_size=16, dtype=dtype,
                             device=kernel_device)
    _, views = fp8_cache_of(batch.kv_cache.float())
    out = flash_prefill_attention(batch.q, views.k, views.v, batch.query_start_loc, batch.seq_lens,
                                  batch.page_tables, batch.scale, max_query_len=batch.max_query_len,
                                  **scales(views))
    ref = reference(batch, k=views.k, v=views.v, **scales(views))
    assert relative_error(out, ref) < tolerance(dtype, kernel_device)


def test_flash_prefill_leaves_the_rows_before_first_seq_alone(kernel_device):
    from flare.kernels.flash_prefill import flash_prefill_attention

    batch = make_paged_batch([(9, 1), (40, 1), (3, 30)], 4, 2, 64, page_size=16, dtype=torch.float32,
                             device=kernel_device)
    out = torch.full_like(batch.q, float("nan"))
    flash_prefill_attention(batch.q, batch.kv_cache[0], batch.kv_cache[1], batch.query_start_loc, batch.seq_lens,
                            batch.page_tables, batch.scale, max_query_len=30, out=out, first_seq=2)
    assert torch.isnan(out[:2]).all()
    ref = reference(batch)
    assert relative_error(out[2:], ref[2:]) < tolerance(torch.float32, kernel_device)


def test_flash_prefill_is_causal(kernel_device):
    """A token's output must not change when a later token of its chunk changes."""
    from flare.kernels.flash_prefill import flash_prefill_attention

    batch = make_paged_batch([(5, 40)], 2, 2, 64, page_size=16, dtype=torch.float32, device=kernel_device)
    run = lambda: flash_prefill_attention(batch.q, batch.kv_cache[0], batch.kv_cache[1], batch.query_start_loc,
                                          batch.seq_lens, batch.page_tables, batch.scale, max_query_len=40)
    before = run()
    last_slot = int(batch.slot_mapping[-1])
    batch.kv_cache[:, last_slot // 16, last_slot % 16] += 5.0
    after = run()
    torch.testing.assert_close(after[:-1], before[:-1])
    assert not torch.allclose(after[-1], before[-1])


def test_flash_prefill_refuses_tiles_tl_dot_cannot_take(kernel_device):
    from flare.kernels.flash_prefill import FlashConfig, flash_prefill_attention

    batch = make_paged_batch([(0, 8)], 2, 2, 64, page_size=16, dtype=torch.float32, device=kernel_device)
    with pytest.raises(ValueError, match="block_n 48: tiles are powers of two"):
        flash_prefill_attention(batch.q, batch.kv_cache[0], batch.kv_cache[1], batch.query_start_loc,
                                batch.seq_lens, batch.page_tables, batch.scale, max_query_len=8,
                                config=FlashConfig(block_m=16, block_n=48))
