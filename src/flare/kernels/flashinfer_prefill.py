"""Paged prefill/extend attention through FlashInfer's FA3 kernels, on Hopper GPUs.

The same function as `flare.kernels.flash_prefill.flash_prefill_attention` (each sequence's new tokens
attend to its cached prefix and causally to each other, GQA, over the paged cache), computed by
FlashInfer's `BatchPrefillWithPagedKVCacheWrapper` with its `fa3` backend: warp-specialized, TMA-fed
kernels that Triton 3.6 cannot express on SM90 (docs/performance.md: our Triton kernel reaches ~365
TFLOP/s on an 8,192-token prompt on an H200, FlashInfer's FA3 622 on contiguous K/V).

FlashInfer describes a batch by CSR arrays: `qo_indptr` (where each sequence's queries start),
`kv_indptr` (where its pages start in one flat list of page ids) and `last_page_len` (how full its last
page is). `plan_inputs` derives them, on the host, from the step's host copies of the query starts and
context lengths (`AttentionMetadata.host_query_start`, `host_seq_lens`); the page ids themselves are
read out of the step's page table on the device, so no page table crosses to the host. FlashInfer's
`plan` (host-side scheduling of the work over the SMs, and a copy of it to the device) runs once per
step, on the first layer's call; the other layers reuse it.

Only bf16/fp16 caches: the FP8 cache keeps a float32 scale per token and KV head, which FlashInfer's
kernels do not read, so an FP8-KV step keeps Flare's own kernel.

FlashInfer compiles the kernel on first use (about 90 s with nvcc on an H200's host). Where those
builds live, and how a package carries them so that `flare run` builds nothing, is
`flare.kernels.flashinfer_builds`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from flare.kernels.flashinfer_builds import installation_name

FA3_CAPABILITY = (9, 0)                    # FlashInfer's fa3 backend: SM90 (Hopper) only
WORKSPACE_BYTES = 128 * 1024 * 1024        # FlashInfer's float workspace (its documentation's 128 MiB)
KERNEL_NAME = "flashinfer-fa3"             # the plan's name for this kernel (Plan.prefill_attention)


def unavailable_reason(device, dtype) -> str | None:
    """Why FlashInfer's FA3 prefill cannot run on `device` for caches of `dtype` (None when it can)."""
    import torch

    if str(device).split(":")[0] != "cuda" or not torch.cuda.is_available():
        return "FlashInfer's FA3 kernels need a CUDA GPU"
    capability = torch.cuda.get_device_capability(torch.device(device))
    if tuple(capability) != FA3_CAPABILITY:
        return f"FlashInfer's FA3 kernels are built for SM90 (Hopper); this GPU is SM{capability[0]}{capability[1]}"
    if dtype not in (torch.bfloat16, torch.float16):
        return f"FlashInfer's FA3 prefill reads bf16 or fp16 caches, not {dtype} (the FP8 cache keeps Flare's kernel)"
    if installation_name() is None:
        return "FlashInfer is not installed (pip install flashinfer-python)"
    return None


@dataclass(frozen=True)
class PagedPlanInputs:
    """One step's prompt rows in FlashInfer's CSR form (host arrays, int32)."""

    qo_indptr: np.ndarray       # [n + 1]: sequence i's queries are rows [qo_indptr[i], qo_indptr[i+1]) of the slice
    kv_indptr: np.ndarray       # [n + 1]: its pages are entries [kv_indptr[i], kv_indptr[i+1]) of the page list
    last_page_len: np.ndarray   # [n]: tokens in its last page (1..page_size)
    page_positions: np.ndarray  # [kv_indptr[-1]]: each listed page's index into the page table, flattened
    first_row: int              # the step's row where the first of these sequences' queries start


def plan_inputs(query_start: np.ndarray, seq_lens: np.ndarray, first_seq: int, page_size: int,
                table_width: int) -> PagedPlanInputs:
    """The CSR arrays of sequences `first_seq`.. of a step whose query starts are `query_start` [B+1] and
    context lengths (after the step) `seq_lens` [B], over a page table `table_width` pages wide."""
    query_start = np.asarray(query_start, dtype=np.int64)
    seq_lens = np.asarray(seq_lens, dtype=np.int64)[first_seq:]
    if len(query_start) != first_seq + len(seq_lens) + 1:
        raise ValueError(f"{len(query_start)} query starts for {first_seq + len(seq_lens)} sequences")
    if len(seq_lens) and seq_lens.min() < 1:
        raise ValueError("every sequence of a prefill step has at least one token of context")
    pages = -(-seq_lens // page_size)
    if len(pages) and pages.max() > table_width:
        raise ValueError(f"a sequence of {int(seq_lens.max())} tokens needs {int(pages.max())} pages; "
                         f"the page table holds {table_width}")
    kv_indptr = np.zeros(len(pages) + 1, dtype=np.int64)
    np.cumsum(pages, out=kv_indptr[1:])
    rows = np.repeat(np.arange(first_seq, first_seq + len(pages)), pages)
    columns = np.arange(kv_indptr[-1]) - np.repeat(kv_indptr[:-1], pages)
    first_row = int(query_start[first_seq])
    return PagedPlanInputs(
        qo_indptr=(query_start[first_seq:] - first_row).astype(np.int32),
        kv_indptr=kv_indptr.astype(np.int32),
        last_page_len=(seq_lens - (pages - 1) * page_size).astype(np.int32),
        page_positions=(rows * table_width + columns).astype(np.int64),
        first_row=first_row)


class FlashInferPrefill:
    """FlashInfer's FA3 paged prefill for one device, planned once per step (the step's metadata object)."""

    def __init__(self, device) -> None:
        import torch

        self.device = torch.device(device)
        self._wrapper = None
        self._planned_meta = None            # the step metadata of the current plan
        self._planned_shape = None           # (heads, KV heads, head dim, scale) it was planned for
        self._inputs: PagedPlanInputs | None = None

    def _new_wrapper(self):
        import flashinfer
        import torch

        workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        return flashinfer.BatchPrefillWithPagedKVCacheWrapper(workspace, "NHD", backend="fa3")

    def attend(self, query, k_cache, v_cache, meta, scale: float, out):
        """Rows of sequences `meta.num_decodes`.. of `out` [T, Hq, D]: their attention over the paged cache
        (`k_cache`, `v_cache` [num_pages, page_size, Hkv, D]); the rows before them are left alone."""
        shape = (query.shape[1], k_cache.shape[2], query.shape[2], scale)
        if self._planned_meta is not meta or self._planned_shape != shape:
            self._plan(meta, query, k_cache, scale)
            self._planned_meta, self._planned_shape = meta, shape
        first = self._inputs.first_row
        self._wrapper.run(query[first:], (k_cache, v_cache), out=out[first:])
        return out

    def _plan(self, meta, query, k_cache, scale: float) -> None:
        import torch

        if meta.host_query_start is None or meta.host_seq_lens is None:
            raise ValueError("FlashInfer's prefill plans from the step's host copies of its query starts and "
                             "context lengths; this metadata has none")
        if self._wrapper is None:
            self._wrapper = self._new_wrapper()
        page_size = k_cache.shape[1]
        inputs = plan_inputs(meta.host_query_start, meta.host_seq_lens, meta.num_decodes, page_size,
                             meta.page_tables.shape[1])
        positions = torch.from_numpy(inputs.page_positions).to(meta.page_tables.device, non_blocking=True)
        page_ids = meta.page_tables.reshape(-1).index_select(0, positions)
        self._wrapper.plan(torch.from_numpy(inputs.qo_indptr), torch.from_numpy(inputs.kv_indptr), page_ids,
                           torch.from_numpy(inputs.last_page_len), query.shape[1], k_cache.shape[2],
                           query.shape[2], page_size, causal=True, sm_scale=scale, q_data_type=query.dtype,
                           kv_data_type=k_cache.dtype)
        self._inputs = inputs
