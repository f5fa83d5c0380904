"""The KV page pool for serving, sized by `flare.memory` from the device, the limits and the reserve.

`--kv-cache-limit memory` (the default) gives KV pages what the GPU has free after the weights, the driver
margin and the reserve (or within `--memory-limit`); `context` and `concurrency` cap the pool at one
prepared context, or one per active request. Without a GPU the sizing runs against host memory, where
filling RAM with pages would help nobody: there the pool stops at one context per active request.
"""

from __future__ import annotations

from flare.memory import (KV_CACHE_LIMITS, FixedCosts, KVGeometry, KVPool, engine_headroom, memory_budget,
                          parse_memory_limit, read_device_memory, size_kv_pool)
from flare.server.served_model import ServedModel

__all__ = ["KV_CACHE_LIMITS", "KVPool", "kv_bytes_per_token", "parse_memory_limit", "serving_kv_pool"]


def kv_bytes_per_token(hf_config: dict, dtype: str) -> int:
    """K and V of every layer for one token, in the serving dtype."""
    from flare.models import ModelConfig

    cfg = ModelConfig.from_hf_config(hf_config)
    element = {"float32": 4, "float16": 2, "bfloat16": 2}.get(dtype, 4)
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * element


def serving_kv_pool(model: ServedModel, concurrency: int, kv_cache_limit: str, memory_limit: str | None,
                    reserve: int) -> KVPool:
    """Pages for the shared KV pool of one device (raises CapacityError in the section-6 form)."""
    device = read_device_memory()[0]
    limit = parse_memory_limit(memory_limit) if memory_limit else None
    budget = memory_budget(device, engine_headroom("serving"), limit, reserve)
    fixed = FixedCosts(weights=model.weight_bytes, graphs=0, live_state=0, prefix_cache_floor=0)
    geometry = KVGeometry(page_size=model.page_size,
                          bytes_per_token=kv_bytes_per_token(model.hf_config, model.dtype),
                          max_context=model.max_model_len, max_concurrency=concurrency)
    if device.host and kv_cache_limit == "memory":
        kv_cache_limit = "concurrency"
    return size_kv_pool(budget, fixed, geometry, kv_cache_limit)  # type: ignore[arg-type]
