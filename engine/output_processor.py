"""OutputProcessor: sampled tokens -> text, stop strings, logprobs, RequestOutputs.

A request with ``n > 1`` runs as n child requests (ids ``rid#i``) grouped under one
parent; callers only ever see the parent id.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from triptych.engine.detokenizer import IncrementalDetokenizer
from triptych.engine.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from triptych.engine.request import Request


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    children: list[Request]
    detoks: list[IncrementalDetokenizer]
    logprobs: list[list[dict[int, Logprob]]]
    cum_logprob: list[float]
    sent_tokens: list[int]  # per child: token ids already reported
    metrics: RequestMetrics = field(default_factory=lambda: RequestMetrics(time.monotonic()))


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, _Parent] = {}
        self._child: dict[str, tuple[_Parent, int]] = {}

    def add(self, rid: str, prompt: str | None, children: list[Request],
            detoks: list[IncrementalDetokenizer]) -> None:
        k = len(children)
        p = _Parent(rid, prompt, children, detoks, [[] for _ in range(k)], [0.0] * k, [0] * k)
        self.parents[rid] = p
        for i, c in enumerate(children):
            self._child[c.request_id] = (p, i)

    def children(self, rid: str) -> list[Request]:
        p = self.parents.get(rid)
        return list(p.children) if p else []

    def drop(self, rid: str) -> None:
        p = self.parents.pop(rid, None)
        for c in p.children if p else ():
            self._child.pop(c.request_id, None)

    def on_tokens(self, produced: list[Request],
                  logprobs: dict[str, dict[int, float] | None]) -> list[Request]:
        """Detokenize new tokens; return requests that hit a stop string."""
        stopped = []
        now = time.monotonic()
        for req in produced:
            p, i = self._child[req.request_id]
            if p.metrics.first_token_time is None:
                p.metrics.first_token_time = now
            tok = req.output_token_ids[-1]
            lp = logprobs.get(req.request_id)
            if lp is not None:
                ranked = sorted(lp.items(), key=lambda kv: -kv[1])
                p.logprobs[i].append({t: Logprob(v, r + 1, self.tokenizer.decode([t]))
                                      for r, (t, v) in enumerate(ranked)})
                p.cum_logprob[i] += lp[tok]
            hit = p.detoks[i].add_token(tok)
            if hit is not None and not req.finished:
                req.stop_reason = hit
                stopped.append(req)
        return stopped

    def collect(self, produced: list[Request]) -> list[RequestOutput]:
        parents: dict[str, _Parent] = {}
        for req in produced:  # several children of one parent can produce in one step
            p, _ = self._child[req.request_id]
            parents.setdefault(p.request_id, p)
        return [self._output(p) for p in parents.values()]

    def _output(self, p: _Parent) -> RequestOutput:
        comps = []
        for i, (c, d) in enumerate(zip(p.children, p.detoks)):
            finished = c.finished
            ids = list(c.output_token_ids)
            delta_ids = ids[p.sent_tokens[i]:]
            p.sent_tokens[i] = len(ids)
            comps.append(CompletionOutput(
                index=i, text=d.text, token_ids=ids,
                cumulative_logprob=p.cum_logprob[i] if c.sampling_params.logprobs is not None else None,
                logprobs=p.logprobs[i] if c.sampling_params.logprobs is not None else None,
                finish_reason=c.status.finish_reason if finished else None,
                stop_reason=c.stop_reason, text_delta=d.pop_delta(finished),
                token_ids_delta=delta_ids))
        done = all(c.finished for c in p.children)
        p.metrics.num_generation_tokens = sum(len(c.output_token_ids) for c in p.children)
        if done:
            p.metrics.finished_time = time.monotonic()
            self.drop(p.request_id)
        first = p.children[0]
        return RequestOutput(p.request_id, p.prompt, first.prompt_token_ids, comps, done,
                             num_cached_tokens=first.num_cached_tokens, metrics=p.metrics)
