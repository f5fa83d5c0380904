"""Which kernel computes prompt attention: chosen by measurement at export, followed when serving.

Two kernels compute the prompt rows of a step over a bf16/fp16 cache: Flare's Triton kernel
(`flare.kernels.flash_prefill`, everywhere) and FlashInfer's FA3 kernel
(`flare.kernels.flashinfer_prefill`, Hopper GPUs with FlashInfer installed). `choose_prompt_kernel`
runs both on the model's attention shape, an 8,192-token prompt and a batch of two 1,000-token chunks
over 3,000 cached tokens each, checks that FlashInfer's output matches ours, and keeps the faster; the
plan records the choice (`Plan.prefill_attention`) and serving follows it (`use_prompt_kernel`). The FP8
KV cache always keeps the Triton kernel (flare.kernels.flashinfer_prefill says why).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass

TRITON = "triton"
# Relative error (of the output's norm) allowed between the two kernels: both compute in float32 and round
# to bf16, so they differ by a few bf16 ulps (~4e-3 relative); a wrong mask or page differs by order one.
AGREEMENT = 2e-2
CASES = {"8,192-token prompt": [(0, 8192)], "2 x 1,000 over 3,000": [(3000, 1000), (3000, 1000)]}
PAGE_SIZE = 16


@dataclass(frozen=True)
class PromptKernelChoice:
    kernel: str                          # TRITON or flare.kernels.flashinfer_prefill.KERNEL_NAME
    detail: str                          # the measurement, or why FlashInfer was not a candidate


def choose_prompt_kernel(device, dtype, kv_cache_dtype: str, num_heads: int, num_kv_heads: int,
                         head_dim: int) -> PromptKernelChoice:
    """The faster of the two kernels on this GPU for the model's heads; TRITON where FlashInfer cannot run."""
    from flare.kernels.flashinfer_prefill import KERNEL_NAME, FlashInferPrefill, unavailable_reason

    reason = "the FP8 KV cache" if kv_cache_dtype == "fp8" else unavailable_reason(device, dtype)
    if reason is not None:
        return PromptKernelChoice(TRITON, f"Triton prompt attention ({reason})")
    try:
        flashinfer = FlashInferPrefill(device)
        timings = [_time_case(flashinfer, lengths, device, dtype, num_heads, num_kv_heads, head_dim)
                   for lengths in CASES.values()]
    except Exception as exc:                # a failed build or launch: a candidate lost, not the export
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
        return PromptKernelChoice(TRITON, f"Triton prompt attention (FlashInfer failed: {type(exc).__name__}: {first})")
    cases = ", ".join(f"{name} {ours:.2f} / {theirs:.2f} ms" for name, (ours, theirs, _) in zip(CASES, timings))
    worst = max(error for _, _, error in timings)
    if worst > AGREEMENT:
        return PromptKernelChoice(TRITON, f"Triton prompt attention (FlashInfer's output differed by {worst:.1e})")
    faster = sum(theirs for _, theirs, _ in timings) < sum(ours for ours, _, _ in timings)
    kernel = KERNEL_NAME if faster else TRITON
    return PromptKernelChoice(kernel, f"{'FlashInfer FA3' if faster else 'Triton'} prompt attention "
                                      f"(Triton / FlashInfer: {cases})")


def _time_case(flashinfer, lengths, device, dtype, num_heads: int, num_kv_heads: int, head_dim: int):
    """(Triton ms, `flashinfer`'s ms, relative difference of their outputs) on random sequences of
    (cached, new) tokens, pages shuffled through the cache."""
    import torch

    from flare.engine.attention import AttentionMetadata
    from flare.kernels.flash_prefill import flash_prefill_attention

    generator = torch.Generator(device=device).manual_seed(0)
    pages = [-(-(cached + new) // PAGE_SIZE) for cached, new in lengths]
    order = torch.randperm(sum(pages) + 1, generator=generator, device=device).tolist()
    tables = [order[sum(pages[:i]):sum(pages[:i + 1])] for i in range(len(pages))]
    meta = AttentionMetadata.build([new for _, new in lengths], [c + n for c, n in lengths], tables, PAGE_SIZE, device)
    shape = (sum(pages) + 1, PAGE_SIZE, num_kv_heads, head_dim)
    k_cache, v_cache = (torch.randn(shape, generator=generator, device=device).to(dtype) for _ in range(2))
    query = torch.randn(meta.num_tokens, num_heads, head_dim, generator=generator, device=device).to(dtype)
    scale = head_dim ** -0.5
    ours, theirs = torch.empty_like(query), torch.empty_like(query)

    def triton_kernel():
        flash_prefill_attention(query, k_cache, v_cache, meta.query_start_loc, meta.seq_lens, meta.page_tables,
                                scale, max_query_len=meta.max_query_len, out=ours)

    def flashinfer_kernel():
        flashinfer.attend(query, k_cache, v_cache, meta, scale, theirs)

    times = (_cuda_ms(triton_kernel), _cuda_ms(flashinfer_kernel))
    error = float((theirs.float() - ours.float()).norm() / ours.float().norm())
    return (*times, error)


def _cuda_ms(fn, runs: int = 5) -> float:
    """Median ms of `fn` over `runs` calls after one warm call, by CUDA events."""
    import torch

    from flare.bench import cuda_event_timer

    fn()
    torch.cuda.synchronize()
    timed = cuda_event_timer()
    return statistics.median(timed(fn) for _ in range(runs))


def use_prompt_kernel(model, kernel: str, device, dtype) -> PromptKernelChoice:
    """Give the model's Triton attention (its caches of `dtype`) the plan's prompt kernel; a note for the
    start-up log, and the kernel it runs. A plan's FlashInfer choice that cannot run here falls back to the
    Triton kernel, and the note says why. The kernel is loaded (built, when this machine lacks its build)
    here, not in the first request's step."""
    import time

    from flare.engine.attention_triton import TritonBackend
    from flare.kernels.flashinfer_prefill import KERNEL_NAME, FlashInferPrefill, unavailable_reason

    backends = [m.backend for m in model.modules() if isinstance(getattr(m, "backend", None), TritonBackend)]
    if kernel == TRITON or not backends:
        return PromptKernelChoice(TRITON, "")
    if kernel != KERNEL_NAME:
        raise ValueError(f"unknown prompt attention kernel {kernel!r} (known: {TRITON}, {KERNEL_NAME})")
    reason = unavailable_reason(device, dtype)
    if reason is not None:
        return PromptKernelChoice(TRITON, f"the package chose FlashInfer's FA3 prompt attention, but {reason}: "
                                          "Triton prompt attention")
    prefill = FlashInferPrefill(device)
    started = time.perf_counter()
    try:
        _warm(prefill, backends[0], model, device, dtype)
    except Exception as exc:                # a broken install or build: serve on our kernel, and say so
        first = (str(exc).strip().splitlines() or [""])[0][:200]
        return PromptKernelChoice(TRITON, f"the package chose FlashInfer's FA3 prompt attention, but it failed to "
                                          f"load ({type(exc).__name__}: {first}): Triton prompt attention")
    for backend in backends:
        backend.prompt_kernel = prefill
    seconds = time.perf_counter() - started
    built = f" (loading it took {seconds:.0f} s: FlashInfer built it here)" if seconds > 10 else ""
    return PromptKernelChoice(KERNEL_NAME, f"FlashInfer FA3 prompt attention{built}")


def _warm(prefill, backend, model, device, dtype) -> None:
    """One small call, which loads FlashInfer's module for the model's attention shape."""
    import torch

    from flare.engine.attention import AttentionMetadata

    attention = next(m for m in model.modules() if getattr(m, "backend", None) is backend)
    cfg = attention.cfg
    meta = AttentionMetadata.build([PAGE_SIZE], [PAGE_SIZE], [[0]], PAGE_SIZE, device)
    cache = torch.zeros(1, PAGE_SIZE, cfg.num_key_value_heads, cfg.head_dim, dtype=dtype, device=device)
    query = torch.zeros(PAGE_SIZE, cfg.num_attention_heads, cfg.head_dim, dtype=dtype, device=device)
    prefill.attend(query, cache, cache, meta, cfg.head_dim ** -0.5, torch.empty_like(query))
    torch.cuda.synchronize()
