"""Prompt-carrying and mixed steps replayed as piecewise CUDA graphs, one set per bucket of token counts.

Why piecewise: a step that carries a prompt chunk is a few big matrix products per layer, and its GPU
work already dwarfs its launches; what it lost was ~230 us per layer at each hand-off between the
compiled pieces of a layer and the attention call between them (Python, Dynamo's guards, the attention
backend's dispatch), while the GPU waited (docs/performance.md, "Where a step's time goes"). Whole-step
capture would remove the attention launches too, but prefill attention's grid follows the step's
sequences (query tiles per sequence, a mixed step's decode rows), which a captured graph cannot; so
the stretches between attention calls are captured, each one CUDA graph, and attention runs eagerly
between their replays with the step's own metadata, as vLLM's piecewise mode splits its compiled graph
at the attention operator. A replay is one launch per stretch, and the host's work per layer (one
replay, one attention dispatch) stays ahead of the GPU's.

A bucket of `size` tokens serves any step of at most `size` tokens: the step's ids and positions go
into static buffers, the rows past the step's are padding (whatever ids and positions the buffers held:
every stretch works row by row, so they touch nothing real), and attention sees the real rows only:
each stretch ends by copying the layer's query, key and value into static buffers, attention reads
their first rows and its output goes into a static buffer the next stretch reads. Stretches of one
bucket share the memory pool of all buckets: they replay in the order they were captured, one bucket
at a time.

What the model must keep for this (`unsupported_reason` checks what it can): its forward calls the
attention backend once per layer in layer order and touches the step's metadata nowhere else (not so
for dynamic rotary scaling, which reads context lengths), and everything between attention calls works
on each token's row alone.

Buckets (`flare.engine.config.prompt_graph_sizes`): 16 to 512 tokens, the steps whose launches the GPU
cannot hide (decode-heavy mixed steps, chunk tails, verification rounds); larger steps run eagerly, their
matrix work hiding the launches, except with FP8 projections, whose buckets go on to the step budget. A package's plan records them only after `ignition export` captured them on the
GPU and checked their replays against the eager step (`check_prompt_graphs`); serving captures them
again at start-up. On a CPU the same class runs the padded forward eagerly (capture=False), so the
bookkeeping is testable without a GPU.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from flare.engine.cuda_graphs import bucket_for

# The check compares hidden states twice (relative error of the norm). A replay against the same padded step
# run eagerly (the same kernels on the same shapes) tests the capture itself: its stale buffers or a missed
# attention call give errors of order one, exact replays give ~0.
REPLAY_TOLERANCE = 1e-2
# The padded step against the step run unpadded tests that padding rows stay out of the real ones. Padding
# changes every matrix product's row count, hence cuBLAS's tiling and rounding, and bf16 rounding of one
# layer compounds through the next: a 32-layer llama-8b of random bf16 weights differed by 4.1e-02 on an
# H200 (2026-12-02), a real leak of padding rows into attention by far more.
PADDING_TOLERANCE = 1e-1


def unsupported_reason(model) -> str | None:
    """Why `model` cannot run piecewise graphs (None when it can)."""
    from flare.engine.attention_triton import TritonBackend

    backends = {id(m.backend): m.backend for m in model.modules() if hasattr(m, "backend")}
    if not backends or not all(isinstance(b, TritonBackend) for b in backends.values()):
        return "attention does not run the Triton backend"
    rotary = getattr(getattr(model, "model", None), "rotary_emb", None)
    if rotary is not None and rotary.rope.kind == "dynamic":
        return "dynamic rotary scaling reads the step's context lengths outside attention"
    return None


@dataclass(frozen=True)
class AttentionCall:
    """One attention call of the captured forward: which backend, which layer's cache, which scale."""

    backend: object
    kv_cache: torch.Tensor
    scale: float


class PromptGraphs:
    """Static buffers and, per bucket, the captured stretches and the attention calls between them."""

    def __init__(self, model, kv_caches: list[torch.Tensor], sizes: Sequence[int], capture: bool = True) -> None:
        reason = unsupported_reason(model)
        if reason is not None:
            raise ValueError(f"prompt graphs need a model whose layers can be captured between attention calls: "
                             f"{reason}")
        if not sizes or list(sizes) != sorted(set(sizes)) or sizes[0] < 1:
            raise ValueError(f"prompt graph sizes {list(sizes)} must be distinct positive sizes in rising order")
        self.model, self.kv_caches, self.sizes, self.capture = model, kv_caches, tuple(sizes), capture
        self.backends = list({id(m.backend): m.backend for m in model.modules() if hasattr(m, "backend")}.values())
        cfg, largest, device = model.cfg, self.sizes[-1], kv_caches[0].device
        dtype = model.lm_head.matrix.dtype
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        shape = cfg.attention                   # what each attention call takes and gives (MLA: latent rows)
        self.query = torch.zeros(largest, shape.num_heads, shape.qk_dim, dtype=dtype, device=device)
        self.key = torch.zeros(largest, shape.num_kv_heads, shape.qk_dim, dtype=dtype, device=device)
        self.value = torch.zeros(largest, shape.num_kv_heads, shape.v_dim, dtype=dtype, device=device)
        self.attention_out = torch.zeros(largest, shape.num_heads, shape.v_dim, dtype=dtype, device=device)
        self.stretches: dict[int, list[torch.cuda.CUDAGraph]] = {}
        self.calls: dict[int, list[AttentionCall]] = {}
        self.hidden: dict[int, torch.Tensor] = {}

    @property
    def max_tokens(self) -> int:
        return self.sizes[-1]

    def holds(self, num_tokens: int) -> bool:
        return 0 < num_tokens <= self.max_tokens

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        """The step's hidden states `[T, H]` (a view of a static buffer, valid until the next run)."""
        count = input_ids.shape[0]
        size = bucket_for(count, self.sizes)
        if size is None or count == 0:
            raise ValueError(f"a step of {count} tokens is outside the prompt graphs (1 to {self.max_tokens})")
        if not self.capture:
            return self.run_eager(input_ids, positions, meta)
        self.input_ids[:count].copy_(input_ids)
        self.positions[:count].copy_(positions)
        stretches = self.stretches[size]
        stretches[0].replay()
        for call, stretch in zip(self.calls[size], stretches[1:], strict=True):
            self._attend(call, count, meta)
            stretch.replay()
        return self.hidden[size][:count]

    def run_eager(self, input_ids: torch.Tensor, positions: torch.Tensor, meta) -> torch.Tensor:
        """The step padded to its bucket and run eagerly on the static buffers: what a replay computes."""
        count = input_ids.shape[0]
        self.input_ids[:count].copy_(input_ids)
        self.positions[:count].copy_(positions)
        return self._forward(bucket_for(count, self.sizes), self._attend_now(count, meta))[:count]

    def _attend(self, call: AttentionCall, count: int, meta) -> None:
        """One layer's attention over the real rows of the static query, key and value."""
        call.backend.attend(self.query[:count], self.key[:count], self.value[:count], call.kv_cache, meta,
                            call.scale, out=self.attention_out[:count])

    def _stage(self, size: int, query, key, value) -> torch.Tensor:
        """The end of a stretch: the layer's query, key and value into the static buffers."""
        self.query[:size].copy_(query)
        self.key[:size].copy_(key)
        self.value[:size].copy_(value)
        return self.attention_out[:size]

    def _attend_now(self, count: int, meta):
        """The interceptor of an eager padded forward: stage, then attend over the real rows right away."""
        def intercept(backend, query, key, value, kv_cache, scale):
            out = self._stage(query.shape[0], query, key, value)
            self._attend(AttentionCall(backend, kv_cache, scale), count, meta)
            return out
        return intercept

    def _forward(self, size: int, intercept) -> torch.Tensor:
        """The model over the first `size` rows of the static buffers, each attention call intercepted."""
        for backend in self.backends:
            backend.interceptor = intercept
        try:
            return self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, None)
        finally:
            for backend in self.backends:
                backend.interceptor = None

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every bucket, largest first, in one shared memory pool.

        First a forward at the smallest and the largest bucket outside any graph, so that everything
        the stretches run is compiled and initialised (the largest also takes the large-row kernels of
        any size-routed projection); its activations go back to the device before the captures, which
        then hold the largest bucket's activations once, in the pool."""
        if not self.capture:
            return
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for size in sorted({self.sizes[0], self.sizes[-1]}):
                self._forward(size, lambda backend, q, k, v, cache, scale, s=size: self._stage(s, q, k, v))
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        for size in reversed(self.sizes):
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):
                self._capture(size, pool)
            torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()

    def _capture(self, size: int, pool) -> None:
        """One bucket: a graph from the start to the first attention call, one between each two, one from
        the last to the end; the attention calls are recorded, not captured."""
        stretches, calls = [torch.cuda.CUDAGraph()], []

        def split_here(backend, query, key, value, kv_cache, scale):
            out = self._stage(size, query, key, value)
            stretches[-1].capture_end()
            calls.append(AttentionCall(backend, kv_cache, scale))
            stretches.append(torch.cuda.CUDAGraph())
            stretches[-1].capture_begin(pool=pool)
            return out

        stretches[0].capture_begin(pool=pool)
        try:
            hidden = self._forward(size, split_here)
        finally:
            stretches[-1].capture_end()
        self.stretches[size], self.calls[size], self.hidden[size] = stretches, calls, hidden


@dataclass(frozen=True)
class PromptGraphCheck:
    """What `check_prompt_graphs` found: the buckets whose replays match the eager step (empty: none
    did, or none could be captured), a note that says which, the captured graphs when they passed, and the
    device memory their capture took at its peak (buffers, pool and warm-up, over what the device held)."""

    sizes: tuple[int, ...]
    note: str
    graphs: PromptGraphs | None = field(default=None, compare=False, repr=False)
    capture_bytes: int = 0


def check_prompt_graphs(model, kv_caches: list[torch.Tensor], sizes: Sequence[int], pages: Sequence[int],
                        page_size: int, vocab_size: int) -> PromptGraphCheck:
    """Capture `sizes` and replay, for every bucket, a step just inside it (a decoding sequence beside a
    prompt chunk over a cached prefix) against the same step run eagerly; `pages` are KV pages the check
    may write (`pages_to_check` of the largest bucket). All buckets or none: one that fails to capture or
    to match turns them all off."""
    reason = unsupported_reason(model) or (None if kv_caches[0].device.type == "cuda" else "CUDA graphs need a GPU")
    if reason is not None:
        return PromptGraphCheck((), f"not captured: {reason}")
    try:
        torch.cuda.synchronize()
        torch.cuda.empty_cache()                # what the capture takes, not what cached blocks already hold
        held = torch.cuda.memory_reserved()
        torch.cuda.reset_peak_memory_stats()
        graphs = PromptGraphs(model, kv_caches, sizes)
        graphs.capture_all()
        capture_bytes = max(0, torch.cuda.max_memory_reserved() - held)
        errors = [_check_bucket(graphs, model, size, pages, page_size, vocab_size) for size in sizes]
    except (RuntimeError, ValueError) as error:          # a capture the device refused, out of memory, ...
        return PromptGraphCheck((), f"not captured: {type(error).__name__}: {str(error).splitlines()[0][:200]}")
    replay, padding = max(e.replay for e in errors), max(e.padding for e in errors)
    measured = f"replay {replay:.1e} against the padded eager step, padded {padding:.1e} against the unpadded one"
    if replay > REPLAY_TOLERANCE:
        return PromptGraphCheck((), f"not captured: a replay differs from the eager step by {replay:.1e} "
                                    f"(relative), over {REPLAY_TOLERANCE:.0e} ({measured})")
    if padding > PADDING_TOLERANCE:
        return PromptGraphCheck((), f"not captured: padding changes the eager step by {padding:.1e} "
                                    f"(relative), over {PADDING_TOLERANCE:.0e} ({measured})")
    return PromptGraphCheck(tuple(sizes), f"replays match the eager step (worst relative error: {measured})", graphs,
                            capture_bytes)


@dataclass(frozen=True)
class BucketError:
    """Relative errors of one bucket's check step: the replay against the padded step run eagerly, and the
    padded step against the step run unpadded."""

    replay: float
    padding: float


CHECK_PREFIX = 37                 # cached tokens before each sequence of a check step: pages and a partial one


def _check_step(size: int) -> tuple[list[int], list[int]]:
    """(new tokens, context lengths) of the check step of a bucket: size - 3 tokens (at least 1), a
    decoding sequence beside a prompt chunk when there are two or more, both over CHECK_PREFIX cached ones."""
    tokens = max(1, size - 3)
    query_lens = [1, tokens - 1] if tokens > 1 else [1]
    return query_lens, [CHECK_PREFIX + q for q in query_lens]


def pages_to_check(size: int, page_size: int) -> int:
    """The KV pages the check of a bucket of `size` tokens writes."""
    return sum(-(-length // page_size) for length in _check_step(size)[1])


@torch.inference_mode()
def _check_bucket(graphs: PromptGraphs, model, size: int, pages: Sequence[int], page_size: int,
                  vocab_size: int) -> BucketError:
    """One bucket's check step three ways: unpadded and padded eagerly, and replayed."""
    from flare.engine.attention import AttentionMetadata

    query_lens, seq_lens = _check_step(size)
    needed = [-(-length // page_size) for length in seq_lens]
    if sum(needed) > len(pages):
        raise ValueError(f"the check of {size} tokens needs {sum(needed)} KV pages, {len(pages)} given")
    tables = [list(pages[sum(needed[:i]):sum(needed[:i + 1])]) for i in range(len(needed))]
    device = graphs.input_ids.device
    meta = AttentionMetadata.build(query_lens, seq_lens, tables, page_size, device=device)
    generator = torch.Generator(device=device).manual_seed(size)
    count = sum(query_lens)
    input_ids = torch.randint(3, vocab_size, (count,), generator=generator, device=device)
    positions = meta.positions()
    unpadded = model(input_ids, positions, graphs.kv_caches, meta).float()
    padded = graphs.run_eager(input_ids, positions, meta).float()
    replayed = graphs.run(input_ids, positions, meta).float()
    return BucketError(_relative(replayed, padded), _relative(padded, unpadded))


def _relative(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).norm() / expected.norm().clamp_min(1e-30))
