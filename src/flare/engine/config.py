"""The engine's own settings: batch shape, KV pages and length limits. Frozen: built once per engine."""

from __future__ import annotations

from dataclasses import dataclass

from flare.errors import UsageError


@dataclass(frozen=True)
class EngineConfig:
    max_concurrency: int = 8            # requests running at once (decode batch size)
    page_size: int = 16                 # tokens per KV page
    num_pages: int = 256                # KV pages in the cache, shared by all requests
    prefill_chunk: int = 512            # most prompt tokens one request computes in one step
    max_num_batched_tokens: int = 2048  # token budget of one step, decode and prefill together
    max_model_len: int = 2048           # prompt plus output, per request
    enable_prefix_caching: bool = True  # share full KV pages of equal prefixes between requests

    def __post_init__(self) -> None:
        for name in ("max_concurrency", "page_size", "num_pages", "prefill_chunk",
                     "max_num_batched_tokens", "max_model_len"):
            if getattr(self, name) < 1:
                raise UsageError(f"engine setting {name} must be at least 1, got {getattr(self, name)}")
        if self.max_num_batched_tokens < self.max_concurrency:
            # Every running request decodes one token per step; the budget must cover all of them.
            raise UsageError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be at least "
                f"max_concurrency ({self.max_concurrency}); raise the token budget or lower the concurrency")
        if self.kv_capacity_tokens < self.max_model_len:
            # A single request must always fit, or preemption could never make progress.
            raise UsageError(
                f"the KV cache holds {self.kv_capacity_tokens} tokens ({self.num_pages} pages of "
                f"{self.page_size}), fewer than max_model_len {self.max_model_len}; "
                "add pages or lower max_model_len")

    @property
    def kv_capacity_tokens(self) -> int:
        return self.num_pages * self.page_size

    @property
    def max_pages_per_request(self) -> int:
        return -(-self.max_model_len // self.page_size)
