"""FlashInfer's FA3 prompt attention: the CSR arrays it is planned from, and the backend's use of it.

On a CPU FlashInfer cannot run, so its wrapper is replaced by `ReadsLikeFlashInfer`, which computes the
attention the way FlashInfer's documentation defines its inputs (query rows by `qo_indptr`, each
sequence's pages listed in `paged_kv_indices` between `kv_indptr` entries, its last page `last_page_len`
full): the Triton backend with it must give the reference backend's output, so every index we hand over
is the one FlashInfer must read. On a Hopper GPU with FlashInfer the real kernel is compared with ours.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from flare.engine.attention import AttentionMetadata, TorchReferenceBackend, causal_attention
from flare.engine.attention_triton import TritonBackend
from flare.kernels.flashinfer_prefill import FlashInferPrefill, plan_inputs, unavailable_reason
from paged_batch import make_paged_batch, relative_error, tolerance


def test_plan_inputs_list_each_prompt_sequences_pages_after_the_decodes():
    # Two decodes, then a 5-token chunk over 30 cached tokens and a 16-token prompt; pages of 16.
    inputs = plan_inputs(np.array([0, 1, 2, 7, 23]), np.array([40, 3, 35, 16]), first_seq=2, page_size=16,
                         table_width=3)
    assert inputs.first_row == 2
    assert inputs.qo_indptr.tolist() == [0, 5, 21]
    assert inputs.kv_indptr.tolist() == [0, 3, 4]                 # 35 tokens: 3 pages; 16 tokens: 1
    assert inputs.last_page_len.tolist() == [3, 16]
    assert inputs.page_positions.tolist() == [6, 7, 8, 9]        # rows 2 and 3 of a 3-wide table
    assert inputs.qo_indptr.dtype == np.int32 and inputs.page_positions.dtype == np.int64


def test_plan_inputs_refuse_what_the_table_cannot_hold():
    with pytest.raises(ValueError, match="needs 3 pages; the page table holds 2"):
        plan_inputs(np.array([0, 40]), np.array([40]), 0, 16, 2)
    with pytest.raises(ValueError, match="3 query starts for 1 sequences"):
        plan_inputs(np.array([0, 1, 2]), np.array([4]), 0, 16, 2)


class ReadsLikeFlashInfer:
    """BatchPrefillWithPagedKVCacheWrapper's plan/run contract, computed with the reference attention."""

    def __init__(self):
        self.plans = 0

    def plan(self, qo_indptr, kv_indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size,
             causal, sm_scale, q_data_type, kv_data_type):
        assert causal and qo_indptr.device.type == kv_indptr.device.type == last_page_len.device.type == "cpu"
        self.plans += 1
        self.args = (qo_indptr.tolist(), kv_indptr.tolist(), indices.tolist(), last_page_len.tolist(), page_size,
                     sm_scale)

    def run(self, q, caches, out):
        qo, kv, indices, last, page_size, scale = self.args
        assert q.shape[0] == out.shape[0] == qo[-1]
        k_cache, v_cache = caches
        for i in range(len(qo) - 1):
            pages = indices[kv[i]:kv[i + 1]]
            length = (len(pages) - 1) * page_size + last[i]
            keys, values = (cache[pages].flatten(0, 1)[:length] for cache in (k_cache, v_cache))
            out[qo[i]:qo[i + 1]] = causal_attention(q[qo[i]:qo[i + 1]], keys, values, scale)
        return out


@pytest.mark.parametrize("sequences", [
    [(0, 37), (16, 50)],                            # prompts only
    [(16, 1), (100, 1), (61, 20), (3, 5), (0, 33)],  # decodes first, then chunks over cached prefixes
])
def test_the_backend_with_flashinfer_prompts_matches_the_reference(kernel_device, sequences, monkeypatch):
    batch = make_paged_batch(sequences, num_heads=4, num_kv_heads=2, head_dim=16, page_size=16,
                             dtype=torch.float32, device=kernel_device)
    lens = [new for _, new in sequences]
    tables = [[int(p) for p in row[:-(-(c + n) // 16)]] for row, (c, n) in zip(batch.page_tables, sequences)]
    meta = AttentionMetadata.build(lens, [c + n for c, n in sequences], tables, 16, kernel_device)
    key = torch.randn(meta.num_tokens, 2, 16, device=kernel_device)
    value = torch.randn_like(key)
    expected = TorchReferenceBackend().forward(batch.q, key, value, batch.kv_cache.clone(), meta, batch.scale)
    backend, fake = TritonBackend(), ReadsLikeFlashInfer()
    backend.prompt_kernel = FlashInferPrefill(kernel_device)
    monkeypatch.setattr(backend.prompt_kernel, "_new_wrapper", lambda: fake)
    for _ in range(2):                              # two layers of one step: planned once
        got = backend.forward(batch.q, key, value, batch.kv_cache.clone(), meta, batch.scale)
        assert relative_error(got, expected) < tolerance(torch.float32, kernel_device)   # tf32 dots on a GPU
    assert fake.plans == 1


def test_an_fp8_cache_keeps_the_triton_kernel(kernel_device):
    """FlashInfer does not read the FP8 cache's per-token scales: its prompt rows stay ours."""
    from flare.engine.attention import allocate_kv_caches

    class Refuses:
        def attend(self, *args):
            raise AssertionError("FlashInfer was given an FP8 cache")

    class Cfg:
        kv_cache_dtype, num_key_value_heads, head_dim, num_hidden_layers, mla = "fp8", 2, 16, 1, None

    [cache] = allocate_kv_caches(Cfg, 4, 16, torch.float32, kernel_device)
    meta = AttentionMetadata.build([20], [20], [[0, 1]], 16, kernel_device)
    q, k = torch.randn(20, 4, 16, device=kernel_device), torch.randn(20, 2, 16, device=kernel_device)
    backend = TritonBackend()
    backend.prompt_kernel = Refuses()
    expected = TritonBackend().forward(q, k, k, cache.clone(), meta, 0.25)
    torch.testing.assert_close(backend.forward(q, k, k, cache, meta, 0.25), expected, atol=0, rtol=0)


def test_flashinfer_is_no_candidate_off_a_hopper_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is here")
    assert unavailable_reason("cpu", torch.bfloat16) == "FlashInfer's FA3 kernels need a CUDA GPU"


@pytest.mark.gpu
@pytest.mark.skipif(unavailable_reason("cuda", torch.bfloat16) is not None, reason="needs Hopper and FlashInfer")
def test_flashinfer_fa3_matches_flash_prefill_at_bf16():
    from flare.kernels.flash_prefill import flash_prefill_attention

    sequences = [(16, 1), (0, 700), (3000, 1000), (61, 200)]
    batch = make_paged_batch(sequences, num_heads=32, num_kv_heads=8, head_dim=128, page_size=16,
                             dtype=torch.bfloat16, device="cuda")
    lens = [new for _, new in sequences]
    tables = [[int(p) for p in row[:-(-(c + n) // 16)]] for row, (c, n) in zip(batch.page_tables, sequences)]
    meta = AttentionMetadata.build(lens, [c + n for c, n in sequences], tables, 16, "cuda")
    k_cache, v_cache = batch.kv_cache[0], batch.kv_cache[1]
    ours = flash_prefill_attention(batch.q, k_cache, v_cache, meta.query_start_loc, meta.seq_lens,
                                   meta.page_tables, batch.scale, max_query_len=meta.max_query_len,
                                   first_seq=meta.num_decodes, out=torch.zeros_like(batch.q))
    theirs = FlashInferPrefill("cuda").attend(batch.q, k_cache, v_cache, meta, batch.scale, torch.zeros_like(batch.q))
    rows = slice(meta.num_decodes, None)
    error = (theirs[rows].float() - ours[rows].float()).norm() / ours[rows].float().norm()
    assert error < 1e-2
