"""Multi-query decode attention (1 + k new tokens per sequence, split-K, GQA rows in one tile) computes
the function of prefill attention's torch reference, over the bf16/fp16/fp32 cache and the FP8 cache."""

from __future__ import annotations

import pytest
import torch

from paged_batch import make_paged_batch, relative_error, tolerance
from test_fp8_kv_cache import fp8_cache_of, scales


def run(batch, num_splits, **fp8):
    from flare.kernels.multi_query_attention import multi_query_attention

    out = torch.full_like(batch.q, float("nan"))
    caches = (fp8.pop("k"), fp8.pop("v")) if fp8 else (batch.kv_cache[0], batch.kv_cache[1])
    multi_query_attention(batch.q, *caches, batch.page_tables, batch.seq_lens, batch.scale, num_splits, out=out,
                          **fp8)
    return out


def reference(batch, **fp8):
    from flare.kernels.multi_query_attention import multi_query_attention_reference

    caches = (fp8.pop("k"), fp8.pop("v")) if fp8 else (batch.kv_cache[0].float(), batch.kv_cache[1].float())
    return multi_query_attention_reference(batch.q.float(), *caches, batch.page_tables, batch.seq_lens,
                                           batch.scale, **fp8)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("queries,contexts,num_heads,num_kv_heads,head_dim", [
    (2, [2, 30, 47], 4, 4, 64),          # a context no longer than its new tokens
    (4, [20, 64, 9], 8, 2, 64),          # GQA 4: 16 rows in one tile
    (9, [20, 100], 8, 2, 96),            # 1 + 8 drafts, 36 rows, head_dim below its tile
])
@pytest.mark.parametrize("num_splits", [1, 3])
def test_multi_query_matches_reference(kernel_device, dtype, queries, contexts, num_heads, num_kv_heads, head_dim,
                                       num_splits):
    batch = make_paged_batch([(length - queries, queries) for length in contexts], num_heads, num_kv_heads,
                             head_dim, page_size=16, dtype=dtype, device=kernel_device)
    out = run(batch, num_splits)
    assert torch.isfinite(out).all()
    assert relative_error(out, reference(batch)) < tolerance(dtype, kernel_device)


def test_multi_query_splits_that_a_row_cannot_see_weigh_nothing(kernel_device):
    """Context 20 in three splits of 16 keys: the earliest rows see nothing of the second split."""
    batch = make_paged_batch([(11, 9)], 4, 2, 64, page_size=16, dtype=torch.float32, device=kernel_device)
    assert relative_error(run(batch, 3), reference(batch)) < tolerance(torch.float32, kernel_device)


def test_multi_query_of_one_token_equals_decode(kernel_device):
    from flare.kernels.decode_attention import decode_attention

    batch = make_paged_batch([(40, 1), (2, 1)], 8, 2, 64, page_size=16, dtype=torch.float32, device=kernel_device)
    decode = decode_attention(batch.q, batch.kv_cache[0], batch.kv_cache[1], batch.page_tables, batch.seq_lens,
                              batch.scale, num_splits=2)
    assert relative_error(run(batch, 2), decode) < tolerance(torch.float32, kernel_device)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_multi_query_over_an_fp8_cache_matches_reference(kernel_device, dtype):
    batch = make_paged_batch([(30, 3), (5, 3)], 8, 2, 64, page_size=16, dtype=dtype, device=kernel_device)
    _, views = fp8_cache_of(batch.kv_cache.float())
    out = run(batch, 2, k=views.k, v=views.v, **scales(views))
    assert relative_error(out, reference(batch, k=views.k, v=views.v, **scales(views))) < tolerance(dtype, kernel_device)


def test_multi_query_refuses_uneven_token_counts(kernel_device):
    batch = make_paged_batch([(30, 3), (5, 2)], 4, 2, 64, page_size=16, dtype=torch.float32, device=kernel_device)
    with pytest.raises(ValueError, match="not the same number for each of 2 sequences"):
        run(batch, 1)
