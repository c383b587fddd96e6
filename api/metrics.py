"""Prometheus metrics (vLLM's names with the ``triptych:`` prefix, so dashboards built for
vLLM work after a prefix rename). Engine gauges and counters come from the engine client's
stats on each scrape (api/engine_metrics.py); what the API process sees of each request
(latencies, token counts, finish reasons, request parameters) is measured here.

Per request: ``request_params_n`` / ``request_params_max_tokens`` /
``request_max_num_generation_tokens`` when it is submitted, then per completion
(``n`` per prompt, as vLLM counts child requests) its finish reason, output tokens and
latencies, and per engine request (prompt) its prompt tokens and cache accounting.
"""
from __future__ import annotations

import time
from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.metrics_core import Metric
from triptych.api.engine_metrics import EngineCollector

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5,
                5.0, 7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
ITL_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0,
               7.5, 10.0, 20.0, 40.0, 80.0)
LATENCY_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0,
                   60.0, 120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
FINISH_REASONS = ("stop", "length", "abort", "error")


def buckets_1_2_5(max_value: int) -> list[int]:
    """1, 2, 5, 10, 20, 50, ... up to max_value (vLLM's token-count buckets)."""
    out, scale = [], 1
    while True:
        for m in (1, 2, 5):
            if m * scale > max_value:
                return out
            out.append(m * scale)
        scale *= 10


class RequestTimes:
    """Arrival, first token and the last token of each completion of one engine request."""

    def __init__(self, arrival: float, n: int) -> None:
        self.arrival = arrival
        self.first: float | None = None
        self.last = [0.0] * n
        self.tokens = [0] * n
        self.finished = [False] * n


# Families that answer "has anyone sent this content?": the caches tenants share by content
# (processor and encoder cache: hits, queries, bytes held; a probe image's hit, or the bytes
# that did not grow, says someone sent it). Only the operator's view holds them.
SHARED_CACHE_FAMILIES = ("triptych:mm_processor_cache", "triptych:mm_cache",
                         "triptych:encoder_cache")


class TenantView:
    """The registry without SHARED_CACHE_FAMILIES: what /metrics shows a tenant's key (or
    no key) on a server with API keys (docs/tenancy.md)."""

    def __init__(self, registry: CollectorRegistry) -> None:
        self.registry = registry

    def collect(self) -> Iterator[Metric]:
        for family in self.registry.collect():
            if not family.name.startswith(SHARED_CACHE_FAMILIES):
                yield family


class Metrics:
    def __init__(self, stats: Callable[[], dict[str, float]], model_name: str = "",
                 max_model_len: int = 8192, cache_info: dict[str, str] | None = None,
                 mm_items: Callable[[], int] = lambda: 0) -> None:
        self.registry = r = CollectorRegistry()
        self.tenant_view = TenantView(r)
        self.mm_items = mm_items  # images/videos P0 processed (the processor cache's queries)
        r.register(EngineCollector(stats, model_name, self._local, cache_info or {}))
        lab, self._values = ["model_name", "engine"], [model_name, "0"]
        tokens = buckets_1_2_5(max_model_len)

        def hist(name: str, doc: str, buckets: tuple | list) -> Histogram:
            return Histogram(f"triptych:{name}", doc, lab, buckets=buckets, registry=r)

        self.ttft = hist("time_to_first_token_seconds", "Time to first token", TTFT_BUCKETS)
        self.itl = hist("inter_token_latency_seconds", "Time between two outputs of a "
                                                       "completion", ITL_BUCKETS)
        self.tpot = hist("time_per_output_token_seconds", "Mean time per output token after "
                                                          "the first (DEPRECATED alias of "
                                                          "request_time_per_output_token_"
                                                          "seconds)", ITL_BUCKETS)
        self.req_tpot = hist("request_time_per_output_token_seconds",
                             "Mean time per output token after the first, per request",
                             ITL_BUCKETS)
        self.e2e = hist("e2e_request_latency_seconds", "Request latency", LATENCY_BUCKETS)
        self.prompt_tokens = hist("request_prompt_tokens", "Prompt tokens per request", tokens)
        self.gen_tokens = hist("request_generation_tokens", "Output tokens per request", tokens)
        self.kv_computed = hist("request_prefill_kv_computed_tokens", "Prompt tokens computed "
                                                                      "(not cached)", tokens)
        self.params_n = hist("request_params_n", "The n request parameter", [1, 2, 5, 10, 20])
        self.params_max_tokens = hist("request_params_max_tokens", "The max_tokens request "
                                                                   "parameter", tokens)
        self.max_gen_tokens = hist("request_max_num_generation_tokens",
                                   "Most output tokens a request may produce", tokens)
        self.success = Counter("triptych:request_success", "Finished requests by reason",
                               lab + ["finished_reason"], registry=r)
        for reason in FINISH_REASONS:  # present from the start, as vLLM's
            self.success.labels(*self._values, reason)
        self.cached = Counter("triptych:prompt_tokens_cached", "Prompt tokens served from the "
                                                               "prefix cache", lab, registry=r)
        self.by_source = Counter("triptych:prompt_tokens_by_source", "Prompt tokens by source",
                                 lab + ["source"], registry=r)

    def _local(self) -> dict[str, float]:
        return {"mm_processor_cache_queries": float(self.mm_items()),
                "mm_processor_cache_hits": 0.0}

    def _v(self, h: Histogram) -> Histogram:
        return h.labels(*self._values)

    def request_submitted(self, n: int, max_tokens: int | None, max_gen: int) -> None:
        self._v(self.params_n).observe(n)
        if max_tokens is not None:
            self._v(self.params_max_tokens).observe(max_tokens)
        self._v(self.max_gen_tokens).observe(max_gen)

    def tokens_arrived(self, t: RequestTimes, index: int, count: int) -> None:
        """``count`` tokens of completion ``index`` arrived now."""
        now = time.monotonic()
        if t.first is None:
            t.first = now
            self._v(self.ttft).observe(now - t.arrival)
        elif t.tokens[index]:  # (several at once: a whole answer's, reported at its
            # end (router/output_processor.py, quiet): their mean gap, once)
            self._v(self.itl).observe((now - t.last[index]) / count)
        t.last[index] = now
        t.tokens[index] += count

    def completion_finished(self, t: RequestTimes, index: int, reason: str | None) -> None:
        if t.finished[index]:
            return
        t.finished[index] = True
        now = time.monotonic()
        self.success.labels(*self._values, reason or "abort").inc()
        self._v(self.gen_tokens).observe(t.tokens[index])
        self._v(self.e2e).observe(now - t.arrival)
        if t.first is not None and t.tokens[index] > 1:
            tpot = (t.last[index] - t.first) / (t.tokens[index] - 1)
            self._v(self.tpot).observe(tpot)
            self._v(self.req_tpot).observe(tpot)

    def prompt_seen(self, num_prompt_tokens: int, num_cached_tokens: int) -> None:
        """Once per engine request, when its first output arrives."""
        self._v(self.prompt_tokens).observe(num_prompt_tokens)
        self._v(self.kv_computed).observe(num_prompt_tokens - num_cached_tokens)
        self.cached.labels(*self._values).inc(num_cached_tokens)
        self.by_source.labels(*self._values, "local_compute").inc(
            num_prompt_tokens - num_cached_tokens)
        self.by_source.labels(*self._values, "local_cache_hit").inc(num_cached_tokens)


__all__ = ["Metrics", "RequestTimes", "buckets_1_2_5"]
