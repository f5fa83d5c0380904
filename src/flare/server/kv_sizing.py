"""Sizing the KV page pool: `--kv-cache-limit`, `--memory-limit` and the configured reserve (spec 3.2).

The pool holds the active requests and every cached prefix. `memory` (the default) fills what the GPU has
free after the weights, the engine headroom and the reserve; `context` and `concurrency` cap it at one
prepared context, or one per active request.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from flare.errors import CapacityError, UsageError
from flare.server.served_model import ServedModel

KV_CACHE_LIMITS = ("memory", "context", "concurrency")


@dataclass(frozen=True)
class MemoryLimit:
    kind: str          # "occupied" (at most N bytes), "reserve" (leave N bytes free), "fraction" (of total)
    value: float


def parse_memory_limit(text: str) -> MemoryLimit:
    """`30g` (occupied size), `-30g` (free-memory reserve, `-0g` allowed) or `0.8` (fraction of total)."""
    from flare.config import parse_size

    raw = text.strip()
    if raw.startswith("-"):
        return MemoryLimit("reserve", parse_size(raw[1:], "--memory-limit"))
    try:
        fraction = float(raw)
    except ValueError:
        size = parse_size(raw, "--memory-limit")
        if raw[-1].isdigit() or size <= 0:
            raise UsageError(f"--memory-limit {text}: an occupied size needs a unit suffix such as 30G") from None
        return MemoryLimit("occupied", size)
    if not (math.isfinite(fraction) and 0.0 < fraction <= 1.0):
        raise UsageError(f"--memory-limit {text}: a bare number is a fraction of total memory, "
                         "greater than 0 and at most 1")
    return MemoryLimit("fraction", fraction)


def kv_bytes_per_token(hf_config: dict, dtype: str) -> int:
    from flare.models import ModelConfig

    cfg = ModelConfig.from_hf_config(hf_config)
    element = {"float32": 4, "float16": 2, "bfloat16": 2}.get(dtype, 4)
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * element


@dataclass(frozen=True)
class KVPool:
    pages: int
    page_size: int
    bytes_per_token: int
    limited_by: str

    @property
    def tokens(self) -> int:
        return self.pages * self.page_size

    @property
    def bytes(self) -> int:
        return self.tokens * self.bytes_per_token


def size_kv_pool(model: ServedModel, concurrency: int, kv_cache_limit: str, device: str,
                 memory_limit: MemoryLimit | None, reserve_bytes: int) -> KVPool:
    """Pages for the KV cache: a context per active request by default, bounded as --kv-cache-limit says.

    On a GPU the `memory` mode fills what the device has free after weights, headroom and the reserve
    (or --memory-limit); on the CPU there is no device memory to fill, so the pool is one prepared
    context per active request.
    """
    per_token = kv_bytes_per_token(model.hf_config, model.dtype)
    pages_per_context = -(-model.max_model_len // model.page_size)
    if kv_cache_limit == "context":
        return KVPool(pages_per_context, model.page_size, per_token, "--kv-cache-limit context (one context)")
    ceiling = pages_per_context * concurrency
    if kv_cache_limit == "concurrency":
        return KVPool(ceiling, model.page_size, per_token,
                      f"--kv-cache-limit concurrency ({concurrency} × {model.max_model_len:,}-token context)")
    if device != "cuda":
        return KVPool(ceiling, model.page_size, per_token,
                      f"CPU serving: one context per active request ({concurrency} × {model.max_model_len:,})")
    import torch

    free, total = torch.cuda.mem_get_info()
    headroom = 1 << 30
    if memory_limit is None:
        budget = free - reserve_bytes - headroom - model.weight_bytes
        source = "free GPU memory" + (f" less the {reserve_bytes / 2**30:.1f} GiB reserve" if reserve_bytes else "")
    elif memory_limit.kind == "reserve":
        budget = free - int(memory_limit.value) - headroom - model.weight_bytes
        source = f"--memory-limit -{memory_limit.value / 2**30:.1f}G"
    else:
        cap = memory_limit.value if memory_limit.kind == "occupied" else memory_limit.value * total
        budget = min(free - headroom, int(cap)) - model.weight_bytes
        source = f"--memory-limit ({int(cap) / 2**30:.1f} GiB)"
    pages = max(0, budget) // (per_token * model.page_size)
    if pages < pages_per_context:
        raise CapacityError(
            f"needs {model.weight_bytes / 2**30:.2f} GiB weights + {pages_per_context * model.page_size:,} "
            f"tokens of KV cache ({pages_per_context * model.page_size * per_token / 2**30:.2f} GiB); "
            f"has {max(0, budget + model.weight_bytes) / 2**30:.2f} GiB after {source} and 1.0 GiB headroom. "
            f"Options: a smaller [memory] reserve, or --memory-limit with a larger budget.")
    return KVPool(int(pages), model.page_size, per_token, source)
