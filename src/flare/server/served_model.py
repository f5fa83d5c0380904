"""What is being served, however it was loaded (a package for `flare run`, a checkpoint for debug-serve)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from flare.server.settings import SamplingPolicy


@dataclass(frozen=True)
class ServedModel:
    """What is being served, however it was loaded."""

    canonical_id: str
    served_names: tuple[str, ...]
    hf_config: dict
    frontend_dir: Path
    dtype: str
    page_size: int
    prefill_chunk: int
    prepared_concurrency: int              # the capacity the package was prepared for
    max_model_len: int
    weight_bytes: int
    iter_weights: Callable[[], Iterator[tuple[str, Any]]]
    sampling: SamplingPolicy = field(default_factory=SamplingPolicy)
    memory_reserve_bytes: int = 0
    package_path: Path | None = None       # set for packages: the engine runs in its own process
    decode_capacities: tuple[int, ...] = ()  # the plan's decode graph sizes; empty: the standard catalog
    kv_cache_dtype: str = "auto"           # the plan's KV cache dtype ("fp8": e4m3 with per-token scales)
    online_fp8: tuple[str, ...] = ()       # the plan's decoder projections stored as FP8 at export
    step_costs: Any = None                 # flare.engine.step_cost.StepCosts measured at export; None: none
    prompt_graph_sizes: tuple[int, ...] = ()  # the plan's prompt-step buckets (checked at export); empty: eager
    prompt_graph_bytes: int = 0            # device memory their capture took at export
    speculation: Any = None                # the plan's flare.package.manifest.SpeculationPlan; None: none
    iter_draft_weights: Callable[[], Iterator[tuple[str, Any]]] | None = None   # debug-serve's learned draft
    identity: str | None = None            # packages: the SHA-256 of the signed manifest (retained states' key)
