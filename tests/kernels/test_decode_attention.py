"""Paged split-K decode attention against its torch reference."""

from __future__ import annotations

import pytest
import torch

from paged_batch import TOLERANCE, tolerance, make_paged_batch, relative_error

# (context lengths, query heads, KV heads, head_dim): contexts cross page boundaries (16 per page).
CASES = [
    ([1, 16, 17, 45], 4, 4, 64),        # GQA ratio 1
    ([33, 5, 64], 8, 2, 128),           # GQA ratio 4
    ([20], 2, 1, 96),                   # head_dim below its power-of-two tile
]


def run_decode(batch, num_splits):
    from flare.kernels.decode_attention import decode_attention, decode_attention_reference

    out = torch.full_like(batch.q, float("nan"))                   # every element must be written
    decode_attention(batch.q, batch.kv_cache[0], batch.kv_cache[1], batch.page_tables, batch.seq_lens,
                     batch.scale, num_splits=num_splits, out=out)
    ref = decode_attention_reference(batch.q.float(), batch.kv_cache[0].float(), batch.kv_cache[1].float(),
                                     batch.page_tables, batch.seq_lens, batch.scale)
    return out, ref


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("context_lens,num_heads,num_kv_heads,head_dim", CASES)
@pytest.mark.parametrize("num_splits", [1, 3])
def test_decode_matches_reference(kernel_device, dtype, context_lens, num_heads, num_kv_heads, head_dim,
                                  num_splits):
    batch = make_paged_batch([(length - 1, 1) for length in context_lens], num_heads, num_kv_heads,
                             head_dim, page_size=16, dtype=dtype, device=kernel_device)
    out, ref = run_decode(batch, num_splits)
    assert torch.isfinite(out).all()
    assert relative_error(out, ref) < tolerance(dtype, kernel_device)


def test_decode_reads_only_its_own_pages(kernel_device):
    """Changing K/V in a page outside a sequence's page table must not change its output."""
    from flare.kernels.decode_attention import decode_attention

    batch = make_paged_batch([(20, 1), (9, 1)], 4, 2, 64, page_size=16, dtype=torch.float32,
                             device=kernel_device)
    args = (batch.page_tables, batch.seq_lens, batch.scale)
    before = decode_attention(batch.q, batch.kv_cache[0], batch.kv_cache[1], *args, num_splits=2)
    used = set(batch.page_tables[0, :2].tolist()) | {int(batch.page_tables[1, 0])}
    spare = [page for page in range(batch.kv_cache.shape[1]) if page not in used]
    batch.kv_cache[:, spare] = 1e4
    after = decode_attention(batch.q, batch.kv_cache[0], batch.kv_cache[1], *args, num_splits=2)
    torch.testing.assert_close(after, before)


def test_launcher_rejects_mismatched_shapes(kernel_device):
    from flare.kernels.decode_attention import decode_attention

    batch = make_paged_batch([(3, 1)], 6, 4, 64, page_size=16, dtype=torch.float32, device=kernel_device)
    with pytest.raises(ValueError, match="do not divide"):
        decode_attention(batch.q, batch.kv_cache[0], batch.kv_cache[1], batch.page_tables,
                         batch.seq_lens, batch.scale, num_splits=1)
    batch = make_paged_batch([(3, 1)], 4, 4, 64, page_size=16, dtype=torch.float32, device=kernel_device)
    with pytest.raises(ValueError, match="page_tables"):
        decode_attention(batch.q, batch.kv_cache[0], batch.kv_cache[1], batch.page_tables.long(),
                         batch.seq_lens, batch.scale, num_splits=1)


def test_num_splits_fills_the_gpu_but_keeps_splits_long():
    from flare.kernels.decode_attention import MIN_TOKENS_PER_SPLIT, choose_num_splits

    assert choose_num_splits(batch=1, num_kv_heads=8, max_seq_len=100) == 1
    few = choose_num_splits(batch=1, num_kv_heads=8, max_seq_len=8192)
    assert few > 1 and 8192 / few >= MIN_TOKENS_PER_SPLIT
    assert choose_num_splits(batch=256, num_kv_heads=8, max_seq_len=8192) == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("context_lens,num_heads,num_kv_heads,head_dim",
                         CASES + [([1, 700, 4097, 8192], 32, 8, 128)])
def test_decode_matches_reference_bf16_on_gpu(context_lens, num_heads, num_kv_heads, head_dim):
    from flare.kernels.decode_attention import choose_num_splits

    batch = make_paged_batch([(length - 1, 1) for length in context_lens], num_heads, num_kv_heads,
                             head_dim, page_size=16, dtype=torch.bfloat16, device="cuda")
    splits = choose_num_splits(len(context_lens), num_kv_heads, max(context_lens))
    out, ref = run_decode(batch, splits)
    assert torch.isfinite(out).all()
    assert relative_error(out, ref) < TOLERANCE[torch.bfloat16]
