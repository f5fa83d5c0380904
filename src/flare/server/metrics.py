"""Prometheus metrics, `flare_` names, one registry per app (so several apps can live in one process)."""

from __future__ import annotations

from typing import Any, Callable

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

_TTFT_BUCKETS = (0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 20.0,
                 40.0, 80.0)
_ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.2, 0.3, 0.4,
                0.5, 0.75, 1.0, 2.5, 5.0)
_E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0,
                240.0, 480.0, 960.0)


def _value(stats: Any, key: str) -> float:
    """One number of an EngineStats; `kv_cache_usage` is the fraction of its pages in use,
    `mean_accepted_length` the tokens a verification round brought on average (drafts accepted + 1)."""
    if key == "kv_cache_usage":
        return stats.kv_pages_used / stats.kv_pages_total if stats.kv_pages_total else 0.0
    if key == "prefix_cache_gpu_hit_tokens":
        return float(stats.prefix_cache_hit_tokens - stats.prefix_cache_host_hit_tokens
                     - stats.prefix_cache_disk_hit_tokens - stats.prefix_cache_pool_hit_tokens)
    if key == "mean_accepted_length":
        rounds = stats.speculative_rounds
        return (stats.draft_tokens_accepted + rounds) / rounds if rounds else 0.0
    return float(getattr(stats, key))


# The engine's numbers at scrape time: (metric name, EngineStats field, help). Counters only grow over the
# engine's life, so Prometheus can take rates of them; gauges are the state now.
ENGINE_COUNTERS = (
    ("flare_prefix_cache_hit_tokens", "prefix_cache_hit_tokens", "Prompt tokens served from the prefix cache"),
    ("flare_prefix_cache_miss_tokens", "prefix_cache_miss_tokens", "Prompt tokens the prefix cache did not hold"),
    ("flare_prefix_cache_evicted_pages", "prefix_cache_evicted_pages", "Cached KV pages reclaimed for new content"),
    ("flare_computed_tokens", "num_computed_tokens", "Tokens the model computed, prefill and decode"),
    ("flare_num_preemptions", "num_preemptions", "Requests preempted to free KV pages"),
    ("flare_spec_decode_rounds", "speculative_rounds", "Verification rounds: a request's step that carried drafts"),
    ("flare_spec_decode_draft_tokens", "draft_tokens_proposed", "Draft tokens verified"),
    ("flare_spec_decode_accepted_tokens", "draft_tokens_accepted", "Draft tokens accepted"),
    ("flare_kernel_builds", "kernel_builds", "Triton kernels built while serving (each stalls its step)"),
    ("flare_kernel_build_seconds", "kernel_build_seconds", "Seconds spent building Triton kernels while serving"),
    ("flare_prefix_retention_read_failures", "retained_read_failures",
     "Retained prefix pages on disk found damaged, foreign or gone (recomputed, never served)"),
    ("flare_prefix_retention_write_failures", "retained_write_failures",
     "Retained prefix pages that could not be written to disk (a full disk)"),
)
# Families with one label: (metric name, label, {label value: EngineStats field}, help).
ENGINE_LABELED_COUNTERS = (
    ("flare_prefix_cache_tier_hit_tokens", "tier",
     {"gpu": "prefix_cache_gpu_hit_tokens", "host": "prefix_cache_host_hit_tokens",
      "disk": "prefix_cache_disk_hit_tokens", "pool": "prefix_cache_pool_hit_tokens"},
     "Prompt tokens served from the prefix cache, by the tier their pages came from"),
    ("flare_prefix_retention_bytes", "direction",
     {"gpu_to_host": "retained_bytes_gpu_to_host", "host_to_gpu": "retained_bytes_host_to_gpu",
      "host_to_disk": "retained_bytes_host_to_disk", "disk_to_host": "retained_bytes_disk_to_host",
      "host_to_pool": "retained_bytes_host_to_pool", "pool_to_host": "retained_bytes_pool_to_host"},
     "Bytes of prefix states moved between the tiers of the prefix cache"),
)
ENGINE_LABELED_GAUGES = (
    ("flare_prefix_retention_pages", "tier", {"host": "retained_host_pages", "disk": "retained_disk_pages"},
     "Prefix pages each tier below the GPU holds"),
)
# Per draft position (label position="0" for the first draft of a round).
ENGINE_POSITION_COUNTERS = (
    ("flare_spec_decode_draft_tokens_per_position", "draft_tokens_proposed_by_position",
     "Draft tokens verified at each position of a round"),
    ("flare_spec_decode_accepted_tokens_per_position", "draft_tokens_accepted_by_position",
     "Draft tokens accepted at each position of a round"),
)
ENGINE_GAUGES = (
    ("flare_kv_cache_usage_ratio", "kv_cache_usage", "Fraction of KV cache pages in use"),
    ("flare_num_requests_running", "num_running", "Requests the engine is computing"),
    ("flare_num_requests_waiting", "num_waiting", "Requests queued in the engine"),
    ("flare_kv_cache_pages_used", "kv_pages_used", "KV cache pages in use"),
    ("flare_kv_cache_pages_total", "kv_pages_total", "KV cache pages allocated"),
    ("flare_prefix_cache_resident_pages", "prefix_cache_resident_pages",
     "KV pages holding reusable cached content, in use or not"),
    ("flare_scheduler_max_step_ms", "max_step_ms",
     "The cadence bound the balanced policy keeps on steps that carry decodes, in ms (0: none)"),
    ("flare_spec_decode_mean_accepted_length", "mean_accepted_length",
     "Tokens a verification round brought on average (accepted drafts + 1) over the engine's life"),
    ("flare_prefix_retention_host_slots", "retained_host_slots",
     "Pages the prefix cache's host tier holds at most (0: no host tier)"),
)


class _EngineCollector:
    """Reads the engine's live numbers at scrape time, so they are never stale."""

    def __init__(self, read_stats: Callable[[], Any]) -> None:
        self._read_stats = read_stats          # the engine's EngineStats, or None before there are any

    def collect(self):
        try:
            stats = self._read_stats()
        except Exception:                      # a scrape must not fail because the engine is busy loading
            stats = None
        if stats is None:
            return
        for families, kind in ((ENGINE_COUNTERS, CounterMetricFamily), (ENGINE_GAUGES, GaugeMetricFamily)):
            for name, key, text in families:
                family = kind(name, text)
                family.add_metric([], _value(stats, key))
                yield family
        for families, kind in ((ENGINE_LABELED_COUNTERS, CounterMetricFamily),
                               (ENGINE_LABELED_GAUGES, GaugeMetricFamily)):
            for name, label, keys, text in families:
                family = kind(name, text, labels=[label])
                for value, key in keys.items():
                    family.add_metric([value], _value(stats, key))
                yield family
        for name, key, text in ENGINE_POSITION_COUNTERS:
            family = CounterMetricFamily(name, text, labels=["position"])
            for position, count in enumerate(getattr(stats, key, ())):
                family.add_metric([str(position)], float(count))
            yield family


class ServerMetrics:
    def __init__(self, read_engine_stats: Callable[[], Any]) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter("flare_requests", "Finished HTTP requests by API and outcome",
                                ["api", "outcome"], registry=r)
        self.prompt_tokens = Counter("flare_prompt_tokens", "Prompt tokens admitted", registry=r)
        self.generation_tokens = Counter("flare_generation_tokens", "Tokens generated", registry=r)
        self.time_to_first_token = Histogram("flare_time_to_first_token_seconds",
                                             "Time from arrival to the first output token",
                                             buckets=_TTFT_BUCKETS, registry=r)
        self.inter_token_latency = Histogram("flare_inter_token_latency_seconds",
                                             "Time between consecutive output tokens of a request",
                                             buckets=_ITL_BUCKETS, registry=r)
        self.e2e_latency = Histogram("flare_e2e_request_latency_seconds", "Time from arrival to the last token",
                                     buckets=_E2E_BUCKETS, registry=r)
        r.register(_EngineCollector(read_engine_stats))

    def render(self) -> bytes:
        return generate_latest(self.registry)
