"""What the HTTP layer needs to know about the served model and the listener. Frozen: built once at startup."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Mapping

# The sampling controls a package may declare defaults and model-author ranges for (spec 3.3).
SAMPLING_CONTROLS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty",
                     "presence_penalty", "frequency_penalty")


@dataclass(frozen=True)
class SamplingPolicy:
    """The package's sampling defaults and inclusive model-author ranges.

    A request value is clamped to its control's range; a control with a default but no range is
    fixed at that default; a control the package says nothing about takes the request's value.
    """

    defaults: Mapping[str, float] = field(default_factory=dict)
    ranges: Mapping[str, tuple[float, float]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "defaults", MappingProxyType(dict(self.defaults)))
        object.__setattr__(self, "ranges", MappingProxyType({k: (float(lo), float(hi))
                                                             for k, (lo, hi) in self.ranges.items()}))

    def resolve(self, name: str, requested: float | None) -> float | None:
        """The value a request gets for one control; None leaves the engine's own default."""
        default = self.defaults.get(name)
        if name in self.ranges:
            low, high = self.ranges[name]
            value = requested if requested is not None else default
            return None if value is None else min(max(value, low), high)
        if default is not None:
            return default
        return requested


@dataclass(frozen=True)
class ServerSettings:
    served_names: tuple[str, ...]          # what /v1/models lists and requests may name
    canonical_id: str                      # always accepted; the model card's root
    max_model_len: int                     # prompt + output tokens one request may hold
    max_concurrency: int                   # simultaneously active sequences
    kv_tokens: int | None = None           # tokens the KV page pool holds (None: unknown)
    api_key: str | None = None             # None or "": no authentication
    sampling: SamplingPolicy = field(default_factory=SamplingPolicy)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def body_limit_bytes(self) -> int:
        """Largest request body: room for a full context of long tokens as escaped JSON, at least 8 MiB."""
        return max(8 << 20, self.max_model_len * 64)

    @property
    def accepted_names(self) -> frozenset[str]:
        return frozenset(self.served_names) | {self.canonical_id}
