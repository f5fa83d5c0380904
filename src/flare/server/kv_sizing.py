"""The serving engine's capacity: the KV page pool (sized by `flare.memory`) and the EngineConfig built on it.

There is one sizing path: `flare.estimate.size_kv_pool` gives the pages, `flare.engine.config.
engine_config_for_pool` turns them into the engine's settings. This module only gathers the inputs a
served model brings: device memory, the reserve or `--memory-limit`, bytes per cached token (the recipes'
`kv_bytes_per_token`), and the prepared context and concurrency.

`--kv-cache-limit memory` (the default) gives KV pages what the GPU has free after the weights, graphs (the
prompt graphs' capture as export measured it, since they are captured after the pages) and scratch for the
step's token budget, per-request live state, the engine's headroom and the reserve (or within
`--memory-limit`); `context` and `concurrency` cap the pool at one prepared context, or one per active
request. Without a GPU the sizing runs against host memory, where
filling RAM with pages would help nobody: there the pool stops at one context per active request.
"""

from __future__ import annotations

from flare.engine.config import serving_scratch_bytes, step_token_budget
from flare.estimate import size_kv_pool
from flare.memory import (KV_CACHE_LIMITS, FixedCosts, KVGeometry, KVPool, engine_headroom, memory_budget,
                          parse_kv_cache_limit, parse_memory_limit, read_device_memory)
from flare.recipes.base import kv_bytes_per_token, live_state_bytes_per_request, window_pool
from flare.server.served_model import ServedModel

__all__ = ["KV_CACHE_LIMITS", "KVPool", "serving_engine_config", "serving_kv_pool", "step_token_budget"]

_DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2}


def serving_kv_pool(model: ServedModel, concurrency: int, kv_cache_limit: str, memory_limit: str | None,
                    reserve: int, speculation=None, retention=None) -> KVPool:
    """Pages for the shared KV pool of one device (raises CapacityError in the section-6 form).
    `speculation` (the engine's SpeculationSettings) adds verification scratch and lookahead pages;
    `retention` (RetentionSettings) the prefix cache's cost on the device (`retention_device_bytes`)."""
    from flare.speculation_plan import speculation_memory

    limit_mode = parse_kv_cache_limit(kv_cache_limit)
    device = read_device_memory()[0]
    limit = parse_memory_limit(memory_limit) if memory_limit else None
    budget = memory_budget(device, engine_headroom("serving"), limit, reserve)
    token_bytes = kv_bytes_per_token(model.hf_config, _DTYPE_BYTES.get(model.dtype, 4),
                                     kv_cache_dtype=model.kv_cache_dtype)
    if speculation is not None and speculation.draft_model and speculation.draft_tokens:
        # The draft model's K/V lives in the same pages: each cached token holds both.
        token_bytes += kv_bytes_per_token(model.speculation.draft.config, _DTYPE_BYTES.get(model.dtype, 4))
    drafts = speculation.draft_tokens if speculation is not None and speculation.enabled else 0
    rows = speculation.max_verification_tokens if drafts else None
    verify = speculation_memory(model.hf_config, concurrency, drafts, rows, model.page_size, token_bytes)
    prompt_graphs = model.prompt_graph_bytes if model.prompt_graph_sizes else 0
    fixed = FixedCosts(weights=model.weight_bytes,
                       graphs=serving_scratch_bytes(model.hf_config, concurrency, model.prefill_chunk, model.online_fp8)
                       + verify.scratch + prompt_graphs,
                       live_state=concurrency * (live_state_bytes_per_request(model.hf_config, model.page_size,
                                                                              model.max_model_len)
                                                 + verify.per_request),
                       prefix_cache_floor=retention_device_bytes(retention, device.host),
                       window_pages=serving_window_pool(model, concurrency).bytes(concurrency))
    geometry = KVGeometry(page_size=model.page_size, bytes_per_token=token_bytes,
                          max_context=model.max_model_len, max_concurrency=concurrency)
    if device.host and limit_mode == "memory":
        limit_mode = "concurrency"
    return size_kv_pool(budget, fixed, geometry, limit_mode)


def serving_window_pool(model: ServedModel, concurrency: int):
    """The window pages the served model's cache keeps at `concurrency` (none for most models)."""
    return window_pool(model.hf_config, model.page_size, step_token_budget(model.prefill_chunk, concurrency),
                       _DTYPE_BYTES.get(model.dtype, 4))


def retention_device_bytes(retention, host_device: bool) -> int:
    """What prefix retention takes from the device's budget: its copies' staging buffer on a GPU; on a
    device sized from host memory (no GPU), the host tier itself, which lives in that same memory."""
    from flare.engine.retention.host_pages import STAGING_BYTES

    if retention is None or not retention.enabled:
        return 0
    return retention.host_bytes if host_device else STAGING_BYTES


def serving_engine_config(model: ServedModel, concurrency: int, pool: KVPool, scheduler_policy=None,
                          speculation=None, retention=None):
    """The EngineConfig for serving `model` with `pool`; records which limit bound the pool. Its decode
    graphs are the plan's sizes that `concurrency` needs (all of them at the prepared concurrency), and
    so are its prompt graphs' token buckets (those the step budget at `concurrency` reaches)."""
    from flare.engine.config import engine_config_for_pool, prompt_sizes_for
    from flare.recipes.base import decode_capacities_for

    sizes = decode_capacities_for(model.decode_capacities, concurrency) if model.decode_capacities else ()
    budget = step_token_budget(model.prefill_chunk, concurrency)
    window = serving_window_pool(model, concurrency)
    return engine_config_for_pool(pool, max_concurrency=concurrency, prepared_context=model.max_model_len,
                                  prefill_chunk=model.prefill_chunk, max_num_batched_tokens=budget,
                                  prepared_concurrency=model.prepared_concurrency,
                                  scheduler_policy=scheduler_policy, decode_graph_sizes=sizes,
                                  prompt_graph_sizes=prompt_sizes_for(model.prompt_graph_sizes, budget),
                                  speculation=speculation, window=window, prefix_retention=retention)
