"""What a model keeps in its KV cache, layer by layer: the one statement the allocator, the estimate and
serving all read.

A layer keeps one or more components (a standard layer: its keys and values; a DeepSeek V4 layer: its
sliding window's keys, the inputs of compressor windows not yet closed, compressed entries, indexer keys).
Each component belongs to one of two page kinds:

* "tokens": rows for every token of the sequence from its first, kept while the request lives and shared
  between requests by the prefix cache. A compressed component holds one row per `tokens_per_row` tokens.
* "window": rows only the newest tokens need. A step that computes positions s.. reads back to
  s - `retention`; a request keeps the window pages covering that stretch and gives the older ones back
  (to the prefix cache's LRU when their content is recorded).

Both kinds are paged by the same blocks of `page_size` sequence tokens: block b covers tokens
[b * page_size, (b + 1) * page_size) in every kind, so one chained content hash names block b in both. A
page of a kind holds, for every component of that kind, `page_size / tokens_per_row` rows of
`row_elements` elements. Each component's tensor is `[pages of its kind, rows per page, row_elements]`
(standard K/V keeps its own layout, `flare.engine.attention`, with the same bytes).

Copying a page (the prefix cache's host and disk tiers) means copying row `page` of every component
tensor of the page's kind; nothing else describes a cached block.

Importing this module does not import torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from flare.models.config import ModelConfig
from flare.models.deepseek_v4_config import CSA, HCA
from flare.models.quantization import KV_SCALE_BYTES

PageKind = Literal["tokens", "window"]
DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class CacheComponent:
    layer: int
    name: str                       # "kv"; V4: "window_kv", "compressor_inputs", "compressed", "indexer_inputs", "indexer_keys"
    kind: PageKind
    tokens_per_row: int             # 1: a row per token; m: one compressed row per m tokens
    row_elements: int
    element_bytes: int
    retention: int = 0              # "window": tokens before a step's first position that the step reads

    def rows_per_page(self, page_size: int) -> int:
        return page_size // self.tokens_per_row

    def bytes_per_page(self, page_size: int) -> int:
        return self.rows_per_page(page_size) * self.row_elements * self.element_bytes


@dataclass(frozen=True)
class CacheSpec:
    page_size: int
    components: tuple[CacheComponent, ...]

    def __post_init__(self) -> None:
        for component in self.components:
            if self.page_size % component.tokens_per_row:
                raise ValueError(f"a page of {self.page_size} tokens does not hold whole rows of layer "
                                 f"{component.layer}'s {component.name} ({component.tokens_per_row} tokens a row); "
                                 "the page size must be a multiple of every compression rate")

    def of_kind(self, kind: PageKind) -> tuple[CacheComponent, ...]:
        return tuple(component for component in self.components if component.kind == kind)

    def layer(self, layer: int) -> tuple[CacheComponent, ...]:
        return tuple(component for component in self.components if component.layer == layer)

    @property
    def tokens_page_bytes(self) -> int:
        """Bytes of one "tokens" page: every layer's rows for `page_size` tokens of a sequence."""
        return sum(component.bytes_per_page(self.page_size) for component in self.of_kind("tokens"))

    @property
    def window_page_bytes(self) -> int:
        return sum(component.bytes_per_page(self.page_size) for component in self.of_kind("window"))

    @property
    def bytes_per_token(self) -> float:
        """What each token of a long context costs: the "tokens" kind's bytes over its page."""
        return self.tokens_page_bytes / self.page_size

    @property
    def has_window(self) -> bool:
        return bool(self.of_kind("window"))

    @property
    def window_retention(self) -> int:
        """Tokens before its first position that a step reads from window pages (the widest component's)."""
        return max((component.retention for component in self.of_kind("window")), default=0)

    def window_blocks_before(self, start: int) -> int:
        """The first block a step starting at position `start` reads from window pages."""
        return max(0, start - self.window_retention) // self.page_size

    @property
    def window_pages_per_request(self) -> int:
        """Window pages the pool keeps per active request (`window_pages_for`)."""
        if not self.has_window:
            return 0
        return 2 * -(-self.window_retention // self.page_size) + 3

    def window_pages_for(self, max_concurrency: int, prompt_tokens: int) -> int:
        """Window pages the engine keeps for `max_concurrency` requests and steps of up to `prompt_tokens`
        prompt tokens: what they can hold at once, and the last window of as many finished requests.

        A request between steps holds the blocks over its last `window_retention` tokens (at most
        ceil(retention / page) + 1); its step's new tokens reach one block more, and a step's prompt
        tokens together at most ceil(prompt_tokens / page) beyond that. A finished request leaves its last
        ceil(retention / page) + 1 blocks cached, where the next turn of its conversation matches."""
        if not self.has_window:
            return 0
        return max_concurrency * self.window_pages_per_request + -(-prompt_tokens // self.page_size)

    def window_pool(self, prompt_tokens: int):
        """This cache's window pages as `flare.memory.WindowPool` (empty without a window kind), for steps
        of up to `prompt_tokens` prompt tokens."""
        from flare.memory import WindowPool

        if not self.has_window:
            return WindowPool()
        return WindowPool(self.window_page_bytes, self.window_pages_per_request, -(-prompt_tokens // self.page_size),
                          self.window_retention)

    def sequence_bytes(self, tokens: int) -> int:
        """Bytes one sequence of `tokens` tokens holds once computed: every "tokens" page it covers and
        the window pages over its last `window_retention` tokens."""
        pages = -(-tokens // self.page_size)
        window = min(pages, -(-self.window_retention // self.page_size) + 1) if self.has_window else 0
        return pages * self.tokens_page_bytes + window * self.window_page_bytes


def smallest_page_size(cfg: ModelConfig) -> int:
    """The smallest page holding whole rows of every component: the largest compression rate (1: none)."""
    if cfg.v4 is None:
        return 1
    return max([cfg.v4.rate(kind) for kind in cfg.v4.layer_types] + [1])


def cache_spec(cfg: ModelConfig, page_size: int, dtype_bytes: int) -> CacheSpec:
    """The cache of `cfg` in pages of `page_size` tokens, at `dtype_bytes` per element of the serving dtype."""
    if cfg.v4 is not None:
        return CacheSpec(page_size, deepseek_v4_components(cfg, dtype_bytes))
    if cfg.kv_cache_dtype == "fp8":             # e4m3 values and one float32 scale per head, K and V
        row, element = 2 * cfg.num_key_value_heads * (cfg.head_dim + KV_SCALE_BYTES), 1
    else:
        row, element = 2 * cfg.num_key_value_heads * cfg.head_dim, dtype_bytes
    return CacheSpec(page_size, tuple(CacheComponent(layer, "kv", "tokens", 1, row, element)
                                      for layer in range(cfg.num_hidden_layers)))


def deepseek_v4_components(cfg: ModelConfig, dtype_bytes: int) -> tuple[CacheComponent, ...]:
    """Every V4 layer keeps its sliding window's keys (one 512-wide row per token, K = V) for `window - 1`
    tokens back. A compressed layer also keeps its compressor's inputs (the key and gate projections of
    each token) until the window they pool closes, `m - 1` tokens back for HCA, `2m - 1` for CSA (whose
    entries overlap the previous window), and one entry per `m` tokens for the whole sequence; CSA adds its
    indexer's own compressor inputs and keys. All in the serving dtype, as transformers keeps them."""
    layout, width = cfg.v4, cfg.head_dim
    components = []
    for layer, kind in enumerate(layout.layer_types):
        components.append(CacheComponent(layer, "window_kv", "window", 1, width, dtype_bytes,
                                         layout.sliding_window - 1))
        rate = layout.rate(kind)
        if kind == HCA:
            components += [CacheComponent(layer, "compressor_inputs", "window", 1, 2 * width, dtype_bytes, rate - 1),
                           CacheComponent(layer, "compressed", "tokens", rate, width, dtype_bytes)]
        elif kind == CSA:
            index_width = layout.index_head_dim
            components += [
                CacheComponent(layer, "compressor_inputs", "window", 1, 4 * width, dtype_bytes, 2 * rate - 1),
                CacheComponent(layer, "compressed", "tokens", rate, width, dtype_bytes),
                CacheComponent(layer, "indexer_inputs", "window", 1, 4 * index_width, dtype_bytes, 2 * rate - 1),
                CacheComponent(layer, "indexer_keys", "tokens", rate, index_width, dtype_bytes),
            ]
    return tuple(components)


def mla_bytes_per_token(cfg: ModelConfig, dtype_bytes: int, kv_lora_rank: int = 512) -> int:
    """Bytes per cached token of full-attention MLA (DeepSeek V2/V3: a `kv_lora_rank` latent and the
    rotary key per layer, every token kept) at `cfg`'s layer count and rotary width, the yardstick V4's
    compressed cache is measured against."""
    rope = cfg.v4.rope_dim if cfg.v4 is not None else 64
    return cfg.num_hidden_layers * (kv_lora_rank + rope) * dtype_bytes
