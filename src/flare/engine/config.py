"""The engine's own settings: batch shape, decode graph sizes, KV pages, length limits, scheduler policy and
speculation.

Frozen: built once per engine, by `engine_config_for_pool` from a page supply (a startup KV pool sizing,
`flare.estimate.size_kv_pool`, or a fixed count); derived values are properties.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from flare.engine.policy import SchedulerPolicy
from flare.engine.retention.settings import RetentionSettings
from flare.engine.speculation.settings import SpeculationSettings
from flare.errors import UsageError

KVPoolLimit = Literal["memory", "context", "concurrency"]
KV_POOL_LIMITS = ("memory", "context", "concurrency")


@dataclass(frozen=True)
class EngineConfig:
    max_concurrency: int = 8            # requests running at once (decode batch size)
    page_size: int = 16                 # tokens per KV page
    num_pages: int = 256                # KV pages in the cache, shared by all requests and cached prefixes
    prefill_chunk: int = 512            # most prompt tokens one request computes in one step
    max_num_batched_tokens: int = 2048  # token budget of one step, decode and prefill together
    max_model_len: int = 2048           # prompt plus output, per request
    enable_prefix_caching: bool = True  # share full KV pages of equal prefixes between requests
    scheduler_policy: SchedulerPolicy = field(default_factory=SchedulerPolicy)
    prepared_concurrency: int | None = None   # the package's captured capacity; None: no package
    kv_pool_limited_by: KVPoolLimit = "memory"   # what bound num_pages at startup (for the report)
    # The decode batch sizes asked for: a package's plan records them (`recipes.base.decode_capacities_for`);
    # empty: the standard catalog for max_concurrency. The runner captures `decode_graph_sizes`.
    decode_graph_catalog: tuple[int, ...] = ()
    # The token-count buckets of prompt-carrying and mixed steps captured as piecewise graphs
    # (flare.engine.prompt_graphs); a plan records them once export checked them on the GPU. Empty: eager.
    prompt_graph_sizes: tuple[int, ...] = ()
    # Plan and launch step N+1 while step N runs, its sampled ids staying on the device (EngineCore).
    one_step_ahead: bool = True
    # Speculative decoding: draft tokens per request and step, where they come from, how wide to verify.
    speculation: SpeculationSettings = field(default_factory=SpeculationSettings)
    # A cache with a "window" page kind (flare.models.cache_spec; DeepSeek V4): its page count, and how many
    # tokens before its first position a step reads from them. 0: the cache has no window pages.
    window_pages: int = 0
    window_retention: int = 0
    # Prefix retention below the GPU: host memory, disk, a shared pool (flare.engine.retention). Off by default.
    prefix_retention: RetentionSettings = field(default_factory=RetentionSettings)

    def __post_init__(self) -> None:
        for name in ("max_concurrency", "page_size", "num_pages", "prefill_chunk",
                     "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise UsageError(f"engine setting {name} must be at least 1, got {getattr(self, name)}")
        self._check_graph_sizes()
        if self.prepared_concurrency is not None and self.max_concurrency > self.prepared_concurrency:
            raise UsageError(
                f"--max-concurrency {self.max_concurrency} exceeds the package's prepared concurrency "
                f"{self.prepared_concurrency}; choose {self.prepared_concurrency} or less, or export the "
                f"package again with --max-concurrency {self.max_concurrency}")
        if self.kv_pool_limited_by not in KV_POOL_LIMITS:
            raise UsageError(f"kv_pool_limited_by {self.kv_pool_limited_by!r}: "
                             f"choose one of {', '.join(KV_POOL_LIMITS)}")
        if self.max_num_batched_tokens < self.max_concurrency:
            # Every running request decodes one token per step; the budget must cover all of them.
            raise UsageError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"max_concurrency ({self.max_concurrency}); raise the token budget or lower the concurrency")
        if self.window_pages < 0 or self.window_retention < 0:
            raise UsageError(f"window_pages {self.window_pages} and window_retention {self.window_retention} must "
                             "not be negative")
        if self.kv_capacity_tokens < self.max_model_len:
            # A single request must always fit, or preemption could never make progress.
            raise UsageError(
                f"the KV cache holds {self.kv_capacity_tokens} tokens ({self.num_pages} pages of "
                f"{self.page_size}), fewer than max_model_len {self.max_model_len}; "
                "add pages or lower max_model_len")

    def _check_graph_sizes(self) -> None:
        sizes = self.decode_graph_sizes
        if list(sizes) != sorted(set(sizes)) or sizes[0] < 1:
            raise UsageError(f"decode_graph_sizes {list(sizes)} must be distinct positive sizes in rising order")
        if sizes[-1] < self.max_concurrency:
            raise UsageError(f"decode_graph_sizes {list(sizes)} hold at most {sizes[-1]} requests, fewer than "
                             f"max_concurrency {self.max_concurrency}")
        prompt = self.prompt_graph_sizes
        if not isinstance(prompt, tuple) or (prompt and (list(prompt) != sorted(set(prompt)) or prompt[0] < 1)):
            raise UsageError(f"prompt_graph_sizes {list(prompt)} must be a tuple of distinct positive sizes in "
                             "rising order")

    @property
    def decode_graph_sizes(self) -> tuple[int, ...]:
        """The decode batch sizes the runner captures as graphs: `decode_graph_catalog`, or the standard
        catalog up to max_concurrency."""
        from flare.recipes.base import DECODE_CAPACITIES, decode_capacities_for

        if self.decode_graph_catalog:
            return tuple(self.decode_graph_catalog)
        if self.max_concurrency > DECODE_CAPACITIES[-1]:
            raise UsageError(f"engine setting max_concurrency {self.max_concurrency} exceeds the largest "
                             f"standard decode graph ({DECODE_CAPACITIES[-1]}); give decode_graph_catalog")
        return decode_capacities_for(DECODE_CAPACITIES, self.max_concurrency)

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def max_pages_per_request(self) -> int:
        return -(-self.max_model_len // self.page_size)


@dataclass(frozen=True)
class PageSupply:
    """KV pages an engine gets: a startup pool (`flare.memory.KVPool` has the same fields), or a fixed
    count (export's warm-up, tests and local runs)."""

    pages: int
    page_size: int
    limited_by: str = "memory"


def engine_config_for_pool(pool, *, max_concurrency: int, prepared_context: int, prefill_chunk: int,
                           max_num_batched_tokens: int | None = None,
                           prepared_concurrency: int | None = None,
                           scheduler_policy: SchedulerPolicy | None = None,
                           enable_prefix_caching: bool = True,
                           decode_graph_sizes: tuple[int, ...] = (),
                           prompt_graph_sizes: tuple[int, ...] = (),
                           speculation: SpeculationSettings | None = None, window=None,
                           prefix_retention: RetentionSettings | None = None) -> EngineConfig:
    """The EngineConfig for a KV pool (`PageSupply`, or a `flare.memory.KVPool` sized at startup: pages,
    page_size, limited_by): the one place an engine's settings are derived.

    The pool is the shared page supply for active requests and cached history. The served context is
    the prepared context, or what the pool holds if that is less (spec §4 "Context limit"), so one
    request of the served length always fits: the oldest running request is never preempted, and it
    can grow into every page. `limited_by` ("memory", "context ceiling", "concurrency ceiling")
    becomes `kv_pool_limited_by` ("memory", "context", "concurrency") for the startup report. `window`
    (`flare.memory.WindowPool`): the window pages of a cache that keeps them (DeepSeek V4), at this
    concurrency.
    """
    limited_by = str(pool.limited_by).removesuffix(" ceiling")
    served_context = min(prepared_context, pool.pages * pool.page_size)
    budget = max_num_batched_tokens if max_num_batched_tokens is not None else max(prefill_chunk, max_concurrency)
    return EngineConfig(max_concurrency=max_concurrency, page_size=pool.page_size, num_pages=pool.pages,
                        prefill_chunk=prefill_chunk, max_num_batched_tokens=budget, max_model_len=served_context,
                        enable_prefix_caching=enable_prefix_caching,
                        scheduler_policy=scheduler_policy or SchedulerPolicy(),
                        prepared_concurrency=prepared_concurrency, kv_pool_limited_by=limited_by,
                        decode_graph_catalog=tuple(decode_graph_sizes), prompt_graph_sizes=tuple(prompt_graph_sizes),
                        speculation=speculation or SpeculationSettings(),
                        window_pages=window.pages(max_concurrency) if window is not None else 0,
                        window_retention=window.retention if window is not None else 0,
                        prefix_retention=prefix_retention or RetentionSettings())


def local_engine_config(max_position_embeddings: int, model_config=None, dtype_bytes: int = 4) -> EngineConfig:
    """A modest configuration for tests and local runs of a checkpoint: 8 requests of up to 2048 tokens each
    (pages of 16 tokens, or of the largest compression rate of a DeepSeek V4 cache, with its window pages)."""
    from flare.models.cache_spec import cache_spec, smallest_page_size

    context = min(max_position_embeddings, 2048)
    page_size = max(16, smallest_page_size(model_config)) if model_config is not None else 16
    window = cache_spec(model_config, page_size, dtype_bytes).window_pool(2048) if model_config is not None else None
    return engine_config_for_pool(PageSupply(8 * -(-context // page_size), page_size), max_concurrency=8,
                                  prepared_context=context, prefill_chunk=512, max_num_batched_tokens=2048,
                                  window=window)


# Token buckets of the prompt graphs, up to 512 tokens. Above that a step's GPU work hides its launches:
# on an H200 (2026-12-02, llama-8b, bf16) 2,048 prompt tokens beside 64 decodes took 56.8 ms eager and
# 59.2 ms replayed (padding), while 64 beside 16 took 36.3 ms eager and 16.4 ms replayed; and every bucket
# costs start-up time (21 buckets up to 4,352 tokens: 7.5 s of `flare run`). Larger steps run eagerly.
PROMPT_GRAPH_BUCKETS = (16, 32, 64, 128, 256, 384, 512)
# FP8 projections keep a prompt step host-bound well past 512 tokens (each product quantizes its
# activations and calls _scaled_mm from Python): on an H200 (2026-12-03, llama-8b, FP8 weights and KV) 64
# decodes beside a 1,000-token prompt took 71.6 ms eager for 24.1 ms of kernels (benchmarks/profile_step.py
# --fp8), and eager steps of 512-4,096 prompt tokens 54-109 ms where captured ones of 64-256 took 9-28 ms.
# So FP8 models capture buckets up to the default step budget (two 2,048-token chunks beside 256 decodes).
FP8_PROMPT_GRAPH_BUCKETS = PROMPT_GRAPH_BUCKETS + (768, 1024, 1536, 2048, 2304, 3072, 4352)


def prompt_graph_sizes(max_tokens: int, fp8_projections: bool = False) -> tuple[int, ...]:
    """The token buckets of prompt graphs (flare.engine.prompt_graphs) for steps of up to `max_tokens`
    tokens (the step token budget): those of PROMPT_GRAPH_BUCKETS (FP8_PROMPT_GRAPH_BUCKETS for a model
    with FP8 projections) below it and the first that holds it; steps past the largest run eagerly."""
    return prompt_sizes_for(FP8_PROMPT_GRAPH_BUCKETS if fp8_projections else PROMPT_GRAPH_BUCKETS, max_tokens)


def prompt_sizes_for(sizes, max_tokens: int) -> tuple[int, ...]:
    """The buckets of `sizes` a step budget of `max_tokens` can use: those below it and the first that
    holds it (serving at a lower concurrency than prepared captures fewer)."""
    kept = tuple(s for s in sizes if s < max_tokens)
    holding = [s for s in sizes if s >= max_tokens]
    return kept + tuple(holding[:1])


def step_token_budget(prefill_chunk: int, concurrency: int) -> int:
    """Tokens one engine step may carry: room for two prefill chunks beside a full decode batch.

    `balanced` still carries at most one chunk of prompt work while anyone decodes; the room above it is
    what `throughput` may fill, so the two policies differ."""
    return 2 * prefill_chunk + concurrency


def serving_scratch_bytes(hf_config: dict, concurrency: int, prefill_chunk: int,
                          online_fp8: tuple[str, ...] = ()) -> int:
    """Graphs and scratch of a serving engine: activations for the prompt tokens a step may carry beside
    a full decode batch, the batch's logits, and FP8 models' dequantize buffer (config.json's FP8, or the
    plan's `online_fp8`; recipes.base.graph_and_scratch_bytes). Export and `flare run` both set it aside
    before KV pages."""
    from flare.recipes.base import graph_and_scratch_bytes

    return graph_and_scratch_bytes(hf_config, concurrency, step_token_budget(prefill_chunk, concurrency) - concurrency,
                                   online_fp8=online_fp8)
