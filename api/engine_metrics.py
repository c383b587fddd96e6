"""Prometheus families built, on every scrape, from ``client.stats()``: the engine side of
vLLM's metric names under ``triptych:`` (labels ``model_name``, ``engine`` as vLLM's, plus
``pool``).

The stats dict convention (what an engine client reports; values are floats):

- ``<key>`` for the one colocated engine (exported with ``pool="colocated"``), or
  ``pool/<pool>/<key>`` per worker pool (``pool="<pool>"``). Report a key one way or the
  other; when any ``pool/`` key is present the flat keys are ignored.
- gauges: ``num_requests_running``, ``num_requests_waiting``, ``kv_cache_usage_perc``
  (0-1), ``num_gpu_blocks``, and for each cache in ``mm_processor_cache``,
  ``encoder_cache``, ``prefix_cache``: ``<cache>_usage_bytes``, ``<cache>_capacity_bytes``.
- counters (running totals), ``<name>_total`` or ``<name>``: ``num_preemptions``,
  ``prompt_tokens``, ``generation_tokens``, ``<cache>_queries``, ``<cache>_hits``,
  ``kv_transfer_bytes``.
- histograms: ``<name>_bucket/<le>`` (cumulative counts, ``le`` as Prometheus writes it,
  ``+Inf`` included), ``<name>_sum``, ``<name>_count`` for the names in ENGINE_HISTOGRAMS.
- the router's own counters (ROUTER_COUNTERS) are flat keys beside the ``pool/`` ones and
  are exported with the ``model_name`` label only.
"""
from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client.core import (
    CounterMetricFamily,
    GaugeMetricFamily,
    HistogramMetricFamily,
    Metric,
)

LABELS = ["model_name", "engine", "pool"]
# name -> (stats key, help); vLLM's deprecated aliases point at the same key.
GAUGES = {
    "num_requests_running": ("num_requests_running", "Requests in model execution batches"),
    "num_requests_waiting": ("num_requests_waiting", "Requests waiting to be processed"),
    "kv_cache_usage_perc": ("kv_cache_usage_perc", "KV-cache usage; 1 means 100 percent"),
    "gpu_cache_usage_perc": ("kv_cache_usage_perc", "DEPRECATED alias of kv_cache_usage_perc"),
}
CACHES = ("mm_processor_cache", "encoder_cache", "prefix_cache")
COUNTERS = {
    "num_preemptions": ("num_preemptions", "Requests preempted (recomputed) for KV space"),
    "prompt_tokens": ("prompt_tokens", "Prompt tokens admitted by the engine"),
    "generation_tokens": ("generation_tokens", "Tokens generated"),
    "prefix_cache_queries": ("prefix_cache_queries", "Prefix cache queries, in tokens"),
    "prefix_cache_hits": ("prefix_cache_hits", "Prefix cache hits, in tokens"),
    "gpu_prefix_cache_queries": ("prefix_cache_queries", "DEPRECATED alias"),
    "gpu_prefix_cache_hits": ("prefix_cache_hits", "DEPRECATED alias"),
    "encoder_cache_queries": ("encoder_cache_queries", "Encoder cache lookups, in items"),
    "encoder_cache_hits": ("encoder_cache_hits", "Encoder cache hits, in items"),
    "mm_processor_cache_queries": ("mm_processor_cache_queries", "Processor cache lookups"),
    "mm_processor_cache_hits": ("mm_processor_cache_hits", "Processor cache hits, in items"),
    "mm_cache_queries": ("mm_processor_cache_queries", "vLLM's name: processor cache lookups"),
    "mm_cache_hits": ("mm_processor_cache_hits", "vLLM's name: processor cache hits"),
}
OPTIONAL_COUNTERS = {  # exported once reported (the disaggregated pools)
    "kv_transfer_bytes": ("kv_transfer_bytes", "KV cache bytes sent by prefill workers"),
    "kv_transfer_received_bytes": ("kv_transfer_bytes_received",
                                   "KV cache bytes decode workers received and copied in"),
    "embedding_transfer_bytes": ("embedding_transfer_bytes",
                                 "Vision embedding bytes sent by encode workers"),
    "worker_restarts_by_pool": ("worker_restarts", "Worker restarts, per pool"),
    "tenant_share_deferrals": ("tenant_share_deferrals",
                               "Sequences a step held back or cut to keep a tenant to its "
                               "share (--tenant-step-share)"),
}
ROUTER_COUNTERS = {  # flat keys of the router itself
    "worker_restarts": ("worker_restarts", "Worker processes restarted by the supervisor"),
    "request_migrations": ("request_migrations",
                           "Requests run again on another worker after theirs failed"),
    "first_token_timeouts": ("first_token_timeouts",
                             "Requests failed for no first token in --first-token-timeout"),
}
ENGINE_HISTOGRAMS = {  # exported once reported; P0 cannot measure these
    "iteration_tokens_total": "Tokens per engine step",
    "request_queue_time_seconds": "Time a request spent waiting",
    "request_prefill_time_seconds": "Time a request spent in prefill",
    "request_decode_time_seconds": "Time a request spent in decode",
    "request_inference_time_seconds": "Time a request spent running",
    "time_per_prefill_token_request_seconds": "Prefill time per prompt token",
    "kv_transfer_seconds": "Time to move one KV message (a run of a request's blocks) "
                           "between pools, send to copied in",
    "embedding_transfer_seconds": "Time an encode worker spent encoding and sending one "
                                  "batch of embeddings",
}


def split_pools(stats: dict[str, float]) -> dict[str, dict[str, float]]:
    pools: dict[str, dict[str, float]] = {}
    for key, value in stats.items():
        if key.startswith("pool/") and key.count("/") >= 2:
            _, pool, name = key.split("/", 2)
            pools.setdefault(pool, {})[name] = value
    if not pools:
        pools["colocated"] = {k: v for k, v in stats.items() if not k.startswith("pool/")}
    return pools


def _counter(s: dict[str, float], key: str) -> float | None:
    v = s.get(key + "_total", s.get(key))
    return None if v is None else float(v)


def _histogram(s: dict[str, float], name: str) -> tuple[list[tuple[str, float]], float] | None:
    if name + "_count" not in s:
        return None
    prefix = name + "_bucket/"
    buckets = [(k[len(prefix):], float(v)) for k, v in s.items() if k.startswith(prefix)]
    buckets.sort(key=lambda b: float(b[0]))  # float("+Inf") sorts last
    if not buckets or buckets[-1][0] != "+Inf":
        buckets.append(("+Inf", float(s[name + "_count"])))
    return buckets, float(s.get(name + "_sum", 0.0))


class EngineCollector:
    """Reads the stats on each scrape; ``local`` supplies what P0 counts itself (the
    processor cache, until the stats carry it)."""

    def __init__(self, stats: Callable[[], dict[str, float]], model_name: str,
                 local: Callable[[], dict[str, float]], cache_info: dict[str, str]) -> None:
        self.stats, self.model_name, self.local = stats, model_name, local
        self.cache_info = cache_info

    def collect(self) -> Iterable[Metric]:
        pools = split_pools(dict(self.stats()))
        # vLLM's info gauge: the cache configuration as labels, value 1; the engine's block
        # count once it reports it.
        blocks = next((str(int(s["num_gpu_blocks"])) for s in pools.values()
                       if "num_gpu_blocks" in s), "")
        info = {**self.cache_info, "num_gpu_blocks": blocks, "engine": "0"}
        g = GaugeMetricFamily("triptych:cache_config_info", "Information of the KV cache "
                              "configuration", labels=sorted(info))
        g.add_metric([info[k] for k in sorted(info)], 1.0)
        yield g
        if not any("mm_processor_cache_queries" in s or "mm_processor_cache_queries_total" in s
                   for s in pools.values()):
            first = next(iter(pools.values()))
            first.update(self.local())
        labels = {p: [self.model_name, "0", p] for p in pools}
        flat = self.stats()
        for name, (key, doc) in ROUTER_COUNTERS.items():
            if _counter(flat, key) is not None:
                c = CounterMetricFamily(f"triptych:{name}", doc, labels=["model_name"])
                c.add_metric([self.model_name], _counter(flat, key) or 0.0)
                yield c
        if any("workers_live" in s for s in pools.values()):
            g = GaugeMetricFamily("triptych:workers_live", "Live workers per pool",
                                  labels=LABELS)
            for p, s in pools.items():
                g.add_metric(labels[p], float(s.get("workers_live", 0.0)))
            yield g
        for name, (key, doc) in GAUGES.items():
            g = GaugeMetricFamily(f"triptych:{name}", doc, labels=LABELS)
            for p, s in pools.items():
                g.add_metric(labels[p], float(s.get(key, 0.0)))
            yield g
        for cache in CACHES:
            for suffix in ("usage_bytes", "capacity_bytes"):
                key = f"{cache}_{suffix}"
                have = [(p, s[key]) for p, s in pools.items() if key in s]
                if have:
                    g = GaugeMetricFamily(f"triptych:{key}", f"{cache} {suffix}", labels=LABELS)
                    for p, v in have:
                        g.add_metric(labels[p], float(v))
                    yield g
        optional = {k: v for k, v in OPTIONAL_COUNTERS.items()
                    if any(_counter(s, v[0]) is not None for s in pools.values())}
        for name, (key, doc) in {**COUNTERS, **optional}.items():
            c = CounterMetricFamily(f"triptych:{name}", doc, labels=LABELS)
            for p, s in pools.items():
                c.add_metric(labels[p], _counter(s, key) or 0.0)
            yield c
        for name, doc in ENGINE_HISTOGRAMS.items():
            found = [(p, h) for p, s in pools.items() if (h := _histogram(s, name))]
            if found:
                h = HistogramMetricFamily(f"triptych:{name}", doc, labels=LABELS)
                for p, (buckets, total) in found:
                    h.add_metric(labels[p], buckets, total)
                yield h


__all__ = ["ENGINE_HISTOGRAMS", "EngineCollector", "split_pools"]
