"""The tensors of a layer's cache components (flare.models.cache_spec), for models whose layers keep more
than one K/V tensor (DeepSeek V4). A standard layer keeps its single K/V tensor (flare.engine.attention).

Each component is `[pages of its kind, rows per page, row_elements]` in the serving dtype, zeroed: row
`page` of every tensor of a kind is that page's content, which is all a page copy has to move.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch

from flare.models.cache_spec import CacheSpec


@dataclass(frozen=True)
class LayerCache:
    """One layer's component tensors; None where the layer keeps no such component."""

    window_kv: torch.Tensor | None = None           # window: the sliding window's key (= value) rows
    compressor_inputs: torch.Tensor | None = None   # window: each token's compressor key and gate projections
    compressed: torch.Tensor | None = None          # tokens: compressed entries, one row per `rate` tokens
    indexer_inputs: torch.Tensor | None = None      # window: the indexer compressor's projections
    indexer_keys: torch.Tensor | None = None        # tokens: the indexer's compressed keys

    def tensors(self) -> list[tuple[str, torch.Tensor]]:
        return [(field.name, getattr(self, field.name)) for field in fields(self) if getattr(self, field.name) is not None]


COMPONENT_NAMES = tuple(field.name for field in fields(LayerCache))


def allocate_layer_caches(spec: CacheSpec, num_layers: int, tokens_pages: int, window_pages: int,
                          dtype: torch.dtype, device) -> list[LayerCache]:
    """One LayerCache per layer, every component of `spec` zeroed at its kind's page count."""
    layers: list[dict[str, torch.Tensor]] = [{} for _ in range(num_layers)]
    for component in spec.components:
        if component.name not in COMPONENT_NAMES:
            raise ValueError(f"cache component {component.name!r} has no LayerCache field")
        pages = tokens_pages if component.kind == "tokens" else window_pages
        shape = (pages, component.rows_per_page(spec.page_size), component.row_elements)
        layers[component.layer][component.name] = torch.zeros(shape, dtype=dtype, device=device)
    return [LayerCache(**tensors) for tensors in layers]
