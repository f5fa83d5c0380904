"""What the engine core reports: its numbers after a step (`EngineStats`, sent with every step's outputs and
read by `/v1/engine/stats` and Prometheus), and the requests it refused after taking them in."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class EngineStats:
    """The core's numbers after its latest step. Counters only grow; gauges are the state now."""

    num_running: int                        # gauge
    num_waiting: int                        # gauge: queued, and waiting for their grammars to compile
    kv_pages_used: int                      # gauge: pages requests hold (resident cache pages nobody uses excluded)
    kv_pages_total: int
    num_preemptions: int                    # counter
    prefix_cache_hit_tokens: int = 0        # counter: prompt tokens served from the prefix cache
    prefix_cache_miss_tokens: int = 0       # counter: prompt tokens computed (hits + misses = prompt tokens)
    prefix_cache_evicted_pages: int = 0     # counter: cached pages reclaimed for new content
    prefix_cache_resident_pages: int = 0    # gauge: pages holding reusable cached content, in use or not
    num_computed_tokens: int = 0            # counter: tokens the model computed (prefill and decode)
    # setting: the cadence bound `balanced` keeps on steps that carry decodes, in ms (0: none; policy.py)
    max_step_ms: float = 0.0
    # The page integrity check (`EngineCore.check_integrity`) as of these numbers: "ok", the problem it
    # found, or "unchecked" when these stats were taken without running it.
    page_integrity: str = "unchecked"
    # Speculative decoding, counters (flare.engine.speculation.stats): verification rounds (a request's
    # step that carried drafts), drafts verified and accepted, and both by position (entry j: rounds
    # that carried a draft j, and those whose draft j was accepted).
    speculative_rounds: int = 0
    draft_tokens_proposed: int = 0
    draft_tokens_accepted: int = 0
    draft_tokens_proposed_by_position: tuple[int, ...] = ()
    draft_tokens_accepted_by_position: tuple[int, ...] = ()
    # Triton kernels built since serving started (flare.engine.kernel_builds), counters: how many, and the
    # seconds they took, which the steps that launched them waited; the latest ones' names.
    kernel_builds: int = 0
    kernel_build_seconds: float = 0.0
    kernel_builds_recent: tuple[str, ...] = ()
    # Prefix retention below the GPU (flare.engine.retention), counters: prompt tokens whose pages came
    # from each tier (they count in prefix_cache_hit_tokens too; the rest of those are GPU hits), and the
    # bytes moved each way; gauges: pages each tier holds, and the host tier's slots.
    prefix_cache_host_hit_tokens: int = 0
    prefix_cache_disk_hit_tokens: int = 0
    prefix_cache_pool_hit_tokens: int = 0
    retained_bytes_gpu_to_host: int = 0
    retained_bytes_host_to_gpu: int = 0
    retained_bytes_host_to_disk: int = 0
    retained_bytes_disk_to_host: int = 0
    retained_bytes_host_to_pool: int = 0
    retained_bytes_pool_to_host: int = 0
    retained_read_failures: int = 0         # counter: disk pages found damaged, foreign or gone
    retained_write_failures: int = 0        # counter: disk writes that failed (a full disk)
    retained_host_pages: int = 0
    retained_host_slots: int = 0
    retained_disk_pages: int = 0
    retained_disk_bytes: int = 0            # gauge: what those page files take on disk


@dataclass(frozen=True)
class RefusedRequest:
    """A request the core took in, then refused while preparing it (its grammar failed to compile)."""

    request_id: str
    reason: str                                 # what to change, as InvalidRequest's message
