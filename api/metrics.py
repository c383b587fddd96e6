"""Prometheus metrics (prefix ``triptych:``): engine gauges and counters read from the
engine process's stats on each scrape, latency histograms measured in P0."""
from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

_GAUGES = {
    "num_requests_running": "Requests in the engine's running set",
    "num_requests_waiting": "Requests queued in the engine",
    "kv_cache_usage_perc": "Fraction of KV cache blocks in use (0-1)",
}
_COUNTERS = {  # name (without _total) -> (stats key, help)
    "num_preemptions": ("num_preemptions_total", "Requests preempted (recomputed) for KV space"),
    "prompt_tokens": ("prompt_tokens_total", "Prompt tokens admitted"),
    "generation_tokens": ("generation_tokens_total", "Tokens generated"),
    "prefix_cache_queries": ("prefix_cache_queries", "Prompt tokens looked up in the prefix cache"),
    "prefix_cache_hits": ("prefix_cache_hits", "Prompt tokens found in the prefix cache"),
    "encoder_cache_queries": ("encoder_cache_queries", "Images/videos looked up in the encoder cache"),
    "encoder_cache_hits": ("encoder_cache_hits", "Images/videos found in the encoder cache"),
    "worker_restarts": ("worker_restarts_total", "Worker processes restarted by the supervisor"),
    "request_migrations": ("request_migrations_total",
                           "Requests moved to another worker after theirs died"),
}
_OPTIONAL_COUNTERS = {  # exported once the engine reports them (the disaggregated pools)
    "kv_transfer_bytes": ("kv_transfer_bytes_total", "KV cache bytes moved between pools"),
}
_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0)


class _EngineCollector:
    def __init__(self, stats: Callable[[], dict[str, float]]) -> None:
        self.stats = stats

    def collect(self) -> Iterable[Metric]:
        s = self.stats()
        for name, doc in _GAUGES.items():
            g = GaugeMetricFamily(f"triptych:{name}", doc)
            g.add_metric([], float(s.get(name, 0.0)))
            yield g
        optional = {k: v for k, v in _OPTIONAL_COUNTERS.items() if v[0] in s}
        for name, (key, doc) in {**_COUNTERS, **optional}.items():
            c = CounterMetricFamily(f"triptych:{name}", doc)
            c.add_metric([], float(s.get(key, 0.0)))
            yield c
        # Per pool (router stats keys "pool/<name>/<key>"), labelled like vLLM's engine label.
        pools = sorted({k.split("/")[1] for k in s if k.startswith("pool/")})
        for name, doc in {**_GAUGES, "workers_live": "Live workers in the pool"}.items():
            g = GaugeMetricFamily(f"triptych:pool_{name}", f"{doc}, per pool", labels=["pool"])
            for pool in pools:
                g.add_metric([pool], float(s.get(f"pool/{pool}/{name}", 0.0)))
            yield g


class Metrics:
    def __init__(self, stats: Callable[[], dict[str, float]]) -> None:
        self.registry = CollectorRegistry()
        self.registry.register(_EngineCollector(stats))
        self.ttft = Histogram("triptych:time_to_first_token_seconds", "Time to first token",
                              buckets=_BUCKETS, registry=self.registry)
        self.tpot = Histogram("triptych:time_per_output_token_seconds",
                              "Mean time per output token after the first, per request",
                              buckets=_BUCKETS, registry=self.registry)
        self.e2e = Histogram("triptych:e2e_request_latency_seconds", "Request latency",
                             buckets=_BUCKETS, registry=self.registry)
        self.requests = Counter("triptych:request_success", "Finished requests by reason",
                                ["finished_reason"], registry=self.registry)
        self.mm_cache_queries = Counter("triptych:mm_processor_cache_queries",
                                        "Images/videos processed in P0", registry=self.registry)
        self.mm_cache_hits = Counter("triptych:mm_processor_cache_hits",
                                     "Processor cache hits in P0 (no cache yet: stays 0)",
                                     registry=self.registry)

    def observe_request(self, arrival: float, first_token: float | None, end: float,
                        num_output_tokens: int, reason: str | None) -> None:
        if first_token is not None:
            self.ttft.observe(first_token - arrival)
            if num_output_tokens > 1:
                self.tpot.observe((end - first_token) / (num_output_tokens - 1))
        self.e2e.observe(end - arrival)
        self.requests.labels(reason or "unknown").inc()
