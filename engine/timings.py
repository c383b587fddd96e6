"""RequestTimings: where a worker's requests spend their time, as vLLM's histograms.

    arrival ──queue──> first scheduled ──prefill──> first token ──decode──> finished
                       └──────────────── inference ─────────────────────┘

Kept in the worker (it alone sees these moments) as fixed-bucket histograms in its stats;
the router sums them per pool and /metrics exports them under vLLM's names. A request that
arrived with its first token (a KV import) counts its decode only.
"""
from __future__ import annotations

import time
from typing import Any

from triptych.engine.histogram import Histogram
from triptych.engine.request import Request

TOKEN_BUCKETS = (1.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0, 2048.0, 4096.0,
                 8192.0, 16384.0)


class RequestTimings:
    def __init__(self) -> None:
        self.iteration_tokens = Histogram(TOKEN_BUCKETS)  # per step: vLLM's count (below)
        self.queue = Histogram()
        self.prefill = Histogram()
        self.decode = Histogram()
        self.inference = Histogram()
        self.per_prefill_token = Histogram()

    def on_step(self, sched: Any) -> None:
        now = time.monotonic()
        for req, _ in sched.scheduled:
            if req.first_scheduled_time is None:
                req.first_scheduled_time = now
                self.queue.observe(now - req.arrival_time)

    def on_step_outputs(self, produced: list[Request]) -> None:
        """Once per step, as vLLM counts ``iteration_tokens_total``: the tokens generated
        this step plus the whole prompt (cached part included) of each request whose
        first token came out here. A step that only ran prefill chunks is not counted; a
        request that arrived with tokens (KV import, migration) counts no prompt."""
        n = sum(1 + (r.num_prompt_tokens if r.num_output_tokens == 1 else 0)
                for r in produced)
        if n:
            self.iteration_tokens.observe(n)

    def on_token(self, req: Request) -> None:
        """After a request produced a token (finished or not)."""
        now = time.monotonic()
        start = req.first_scheduled_time or now
        if req.first_token_time is None:
            req.first_token_time = now
            if req.num_resumed_tokens == 0:  # its prompt was computed here
                self.prefill.observe(now - start)
                self.per_prefill_token.observe((now - start) / max(req.num_prompt_tokens, 1))
        if req.finished:
            self.decode.observe(now - req.first_token_time)
            self.inference.observe(now - start)

    def stats(self) -> dict[str, float]:
        return {**self.iteration_tokens.stats("iteration_tokens_total"),
                **self.queue.stats("request_queue_time_seconds"),
                **self.prefill.stats("request_prefill_time_seconds"),
                **self.decode.stats("request_decode_time_seconds"),
                **self.inference.stats("request_inference_time_seconds"),
                **self.per_prefill_token.stats("time_per_prefill_token_request_seconds")}
