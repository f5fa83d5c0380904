"""The Triton attention backend: the AttentionBackend contract on our paged kernels.

Writes the new K/V at slot_mapping, then runs split-K decode attention when every sequence brings one
new token, multi-query decode attention when every sequence brings the same few (2 to
`MAX_QUERY_TOKENS`: a token and its drafts under speculative verification), and prefill/extend
attention otherwise. The prefill kernel would give each query head of such a step a 128-row tile and
read every page once per query head without splitting the context; the multi-query kernel packs the
new tokens of a KV head's whole group into one tile and splits long contexts. A mixed step (decoding requests beside a prompt
chunk) splits: its leading one-token sequences (`meta.num_decodes`) take the decode kernel, the rest
the prefill kernel. The prefill kernel would give each decode row a whole query tile of its own, and
a step of 64 decodes beside a 1,000-token chunk spent 46% of its GPU time there (H200, llama-8b).

Code that torch.compile traces whole sees the work as one custom operator,
`torch.ops.flare.paged_attention`, with no graph break; eager callers skip the operator's dispatch.
Today no caller traces through it (see the note at the operator): it is the planned split point for
piecewise compilation of prompt-carrying steps. Hot path: nothing here but dispatch."""

from __future__ import annotations

import torch

from flare.engine.attention import AttentionBackend, AttentionMetadata, fp8_kv_views, uniform_query_len


def run_paged_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor,
                        query_start_loc: torch.Tensor, seq_lens: torch.Tensor, page_tables: torch.Tensor,
                        slot_mapping: torch.Tensor, scale: float, max_query_len: int,
                        decode_splits: int, num_decodes: int = 0, out: torch.Tensor | None = None) -> torch.Tensor:
    """query [T, Hq, D], key/value [T, Hkv, D], kv_cache [2, pages, page_size, Hkv, D] (or the uint8 FP8
    cache of flare.engine.attention) -> [T, Hq, D], written into `out` when given (query's shape and dtype).

    `num_decodes`: the first sequences bring one new token each (0: unknown); `decode_splits` is the
    split-K count of decode and multi-query attention (over the whole batch, or over those first
    sequences)."""
    return _paged_attention(query, key, value, kv_cache, query_start_loc, seq_lens, page_tables, slot_mapping,
                            scale, max_query_len, decode_splits, num_decodes, out)


def _paged_attention(query, key, value, kv_cache, query_start_loc, seq_lens, page_tables, slot_mapping, scale,
                     max_query_len, decode_splits, num_decodes, out, prompt_kernel=None) -> torch.Tensor:
    """run_paged_attention; `prompt_kernel(query, k_cache, v_cache, out)`, when given (bf16/fp16 caches
    only), computes the prompt rows in place of flash_prefill (the rows of sequences `num_decodes`.. of `out`)."""
    from flare.kernels.decode_attention import decode_attention
    from flare.kernels.flash_prefill import flash_prefill_attention
    from flare.kernels.multi_query_attention import MAX_QUERY_TOKENS, multi_query_attention
    from flare.kernels.prefill_attention import write_kv, write_kv_fp8

    if kv_cache.dtype == torch.uint8:
        cache = fp8_kv_views(kv_cache, key.shape[1], key.shape[2])
        k_cache, v_cache, scales = cache.k, cache.v, {"k_scale": cache.k_scale, "v_scale": cache.v_scale}
        write_kv_fp8(key, value, k_cache, v_cache, cache.k_scale, cache.v_scale, slot_mapping)
    else:
        k_cache, v_cache, scales = kv_cache[0], kv_cache[1], {}
        write_kv(key.to(kv_cache.dtype), value.to(kv_cache.dtype), k_cache, v_cache, slot_mapping)
    queries = uniform_query_len(query.shape[0], seq_lens.shape[0], max_query_len)
    if queries == 1:
        return decode_attention(query, k_cache, v_cache, page_tables, seq_lens, scale, decode_splits, out,
                                **scales)
    if 1 < queries <= MAX_QUERY_TOKENS:
        return multi_query_attention(query, k_cache, v_cache, page_tables, seq_lens, scale, decode_splits, out,
                                     **scales)
    if num_decodes == 0 and prompt_kernel is None:
        return flash_prefill_attention(query, k_cache, v_cache, query_start_loc, seq_lens, page_tables, scale,
                                       max_query_len=max_query_len, out=out, **scales)
    out = torch.empty_like(query) if out is None else out
    if num_decodes:
        decode_attention(query[:num_decodes], k_cache, v_cache, page_tables[:num_decodes], seq_lens[:num_decodes],
                         scale, decode_splits, out=out[:num_decodes], **scales)
    if prompt_kernel is not None:
        return prompt_kernel(query, k_cache, v_cache, out)
    # Not slices of the metadata: offset pointers would change the kernel's alignment specialization
    # with every count of decodes, each one a compile in the middle of serving.
    flash_prefill_attention(query, k_cache, v_cache, query_start_loc, seq_lens, page_tables, scale,
                            max_query_len=max_query_len, out=out, first_seq=num_decodes, **scales)
    return out


# The same function as one custom operator, for code that torch.compile traces whole. Eager callers use
# the function itself: the operator's dispatch costs ~27 us a call on a CPU, once per layer of every
# step run outside the graphs.
#
# Nothing traces through attention today: `engine.compile.compile_model` compiles each decoder layer
# around it (the backend runs eagerly between the compiled pieces), so serving never reaches this
# operator. It is kept on purpose as the split point of piecewise compilation for prompt-carrying
# steps, which is planned next: the whole forward traced once and split at `flare::paged_attention`
# (as vLLM partitions its compiled graph at the operators in `splitting_ops` for piecewise CUDA graphs),
# so the pieces between attentions are compiled and captured while attention runs with the step's own
# metadata. Its fake implementation below is what that tracing needs.
paged_attention = torch.library.custom_op("flare::paged_attention", mutates_args=("kv_cache",))(
    run_paged_attention)


@paged_attention.register_fake
def _paged_attention_shape(query, key, value, kv_cache, query_start_loc, seq_lens, page_tables, slot_mapping,
                           scale, max_query_len, decode_splits, num_decodes=0):
    return torch.empty_like(query)


class TritonBackend(AttentionBackend):
    """Paged attention through the Triton kernels of flare.kernels (CUDA; Triton's interpreter on CPU).

    decode_splits fixes the split-K count of decode attention (and of multi-query attention, whose programs
    are laid out the same way: one per sequence, KV head and split). A captured or compiled decode step needs
    it fixed: pass choose_num_splits(batch, num_kv_heads, longest context served). Left None, it is
    chosen per call from meta.max_seq_len (under torch.compile that value then becomes a guard).
    """

    kernels = "triton"

    # Set only while flare.engine.prompt_graphs captures or stages a forward: it takes each call
    # (`interceptor(backend, query, key, value, kv_cache, scale)`) in the backend's place.
    interceptor = None

    def __init__(self, decode_splits: int | None = None):
        self.decode_splits = decode_splits
        # FlashInfer's FA3 prefill (flare.kernels.flashinfer_prefill.FlashInferPrefill) when the package chose
        # it (`use_prompt_kernel`): eager prompt rows of bf16/fp16 caches take it in place of flash_prefill.
        self.prompt_kernel = None

    def forward(self, query, key, value, kv_cache, meta: AttentionMetadata, scale: float) -> torch.Tensor:
        if self.interceptor is not None:
            return self.interceptor(self, query, key, value, kv_cache, scale)
        return self.attend(query, key, value, kv_cache, meta, scale)

    def attend(self, query, key, value, kv_cache, meta: AttentionMetadata, scale: float,
               out: torch.Tensor | None = None) -> torch.Tensor:
        """The attention itself: `forward` when nothing intercepts it. `out` (eager callers only: the
        custom operator returns a new tensor) takes the result in place of a new tensor."""
        from flare.kernels.decode_attention import choose_num_splits

        splits = self.decode_splits
        if splits is None:
            splits = choose_num_splits(meta.num_decodes or meta.seq_lens.shape[0], key.shape[1],
                                       meta.max_seq_len)
        if torch.compiler.is_compiling():
            if out is not None:
                raise ValueError("attend(out=...) is for eager callers; traced code takes the operator's result")
            return paged_attention(query, key, value, kv_cache, meta.query_start_loc, meta.seq_lens,
                                   meta.page_tables, meta.slot_mapping, scale, meta.max_query_len, splits,
                                   meta.num_decodes)
        prompt = None
        # Not for the FP8 cache: its per-token scales are read by our kernel only.
        if self.prompt_kernel is not None and meta.host_query_start is not None and kv_cache.dtype != torch.uint8:
            def prompt(q, k_cache, v_cache, result):
                return self.prompt_kernel.attend(q, k_cache, v_cache, meta, scale, result)
        return _paged_attention(query, key, value, kv_cache, meta.query_start_loc, meta.seq_lens,
                                meta.page_tables, meta.slot_mapping, scale, meta.max_query_len, splits,
                                meta.num_decodes, out, prompt)
