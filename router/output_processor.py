"""OutputProcessor: token ids from the engine core -> text, stop strings, RequestOutputs.

It runs where the client is (the API process, or in-process for the offline ``LLM``), so
workers only ever handle token ids: detokenization is off the model's critical path, and
a request that moves to another worker keeps its text state here.

A request with ``n > 1`` runs as n child requests (ids ``rid#i``) in the engine; callers
only ever see the parent id. Text is decoded incrementally only when someone reads it as
it grows (streams) or it must be searched (stop strings); otherwise once, at the end.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any

from triptych.engine.outputs import (
    CompletionOutput,
    EngineCoreOutput,
    Logprob,
    RequestMetrics,
    RequestOutput,
)
from triptych.engine.sample.sampling_params import SamplingParams
from triptych.router.detokenizer import IncrementalDetokenizer, token_text, token_texts


def child_requests(request_id: str, params: SamplingParams) -> list[tuple[str, SamplingParams]]:
    """The engine-core requests of one client request: n single completions, seeds spread."""
    if params.n == 1:
        return [(request_id, params)]
    fields = {f: getattr(params, f) for f in params.__struct_fields__}
    # The prompt is the same for every child: child 0 alone computes its logprobs.
    return [(f"{request_id}#{i}",
             SamplingParams(**{**fields, "n": 1, "seed": _child_seed(params.seed, i),
                               "prompt_logprobs": params.prompt_logprobs if i == 0 else None}))
            for i in range(params.n)]


def _child_seed(seed: int | None, i: int) -> int | None:
    """Child i's seed: seed + i, wrapped within int64 (seed 2**63 - 1 with n > 1 is valid)."""
    if seed is None:
        return None
    return (seed + i + 2**63) % 2**64 - 2**63


@dataclass
class _Child:
    request_id: str
    detok: IncrementalDetokenizer
    incremental: bool  # decode as tokens arrive (stream / stop strings) or once at the end
    want_logprobs: bool
    # logprobs as the worker sent them ({id: logprob}), kept only until reported: a
    # request whose reader wants deltas alone (the HTTP server's, ``Router.submit``)
    raw_logprobs: bool = False
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] = field(default_factory=list)
    cum_logprob: float = 0.0
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    sent_tokens: int = 0  # token ids already reported in a delta
    finish_sent: bool = False  # the finish reason was reported (once per completion)


@dataclass
class _Parent:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    children: list[_Child]
    metrics: RequestMetrics
    num_cached_tokens: int = 0
    error: str | None = None
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    # reported at its first token and when a completion ends, not at every step: a reader
    # of deltas alone, not streamed, with no logprobs and no stop strings (a whole answer)
    quiet: bool = False
    reported: bool = False

    @property
    def finished(self) -> bool:
        return all(c.finish_reason is not None for c in self.children)


class OutputProcessor:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.parents: dict[str, _Parent] = {}
        self._child: dict[str, tuple[_Parent, int]] = {}
        self._texts = token_texts(tokenizer)

    def add(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
            params: SamplingParams, stream: bool = True,
            arrival_time: float | None = None,
            deltas_only: bool = False) -> list[tuple[str, SamplingParams]]:
        """Register a client request; returns the (child id, params) pairs to run.
        ``stream``: its text is read as it grows (else decoded once, at the end, unless
        stop strings need it sooner); ``deltas_only``: its reader takes each output's
        deltas and nothing else (the HTTP server), so logprobs stay the worker's plain
        {id: logprob} dicts, kept only until reported (``logprobs`` None, the deltas'
        ``logprobs_delta`` plain dicts): n=16 x 1,500 tokens x 21 alternatives kept as
        Logprob objects were ~500k objects for P0's garbage collector to walk."""
        if request_id in self.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        kids = child_requests(request_id, params)
        children = []
        for cid, sp in kids:
            detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, sp.stop,
                                           sp.skip_special_tokens,
                                           sp.include_stop_str_in_output)
            children.append(_Child(cid, detok, stream or bool(detok.stop),
                                   sp.logprobs is not None, deltas_only))
        p = _Parent(request_id, prompt, list(prompt_token_ids), children,
                    RequestMetrics(arrival_time or time.monotonic()))
        # NOTE: quiet: 128 sequences of whole answers cost P0 an output, a delta and a
        # response update each per step (~0.3 ms a step on a 2-core CPU, beside the step)
        p.quiet = deltas_only and not stream and not any(
            c.incremental or c.want_logprobs for c in children)
        self.parents[request_id] = p
        for i, c in enumerate(children):
            self._child[c.request_id] = (p, i)
        return kids

    def child_ids(self, request_id: str) -> list[str]:
        p = self.parents.get(request_id)
        return [c.request_id for c in p.children] if p else []

    def parent_of(self, child_id: str) -> str | None:
        entry = self._child.get(child_id)
        return entry[0].request_id if entry else None

    def token_ids(self, child_id: str) -> list[int]:
        """Output tokens a child has produced so far (to resume it elsewhere)."""
        p, i = self._child[child_id]
        return list(p.children[i].token_ids)

    def drop(self, request_id: str) -> None:
        p = self.parents.pop(request_id, None)
        for c in p.children if p else ():
            self._child.pop(c.request_id, None)

    # -- the flow -------------------------------------------------------------------------
    def process(self, outs: list[EngineCoreOutput]) -> tuple[list[RequestOutput], list[str]]:
        """Apply one step's core outputs. Returns the outputs of the client requests that
        advanced, and the child ids the engine must abort (they hit a stop string)."""
        touched: dict[str, _Parent] = {}
        ended: set[str] = set()  # parents with a completion ended in these outputs
        to_abort: list[str] = []
        now = time.monotonic()
        for out in outs:
            entry = self._child.get(out.request_id)
            if entry is None:
                continue  # aborted meanwhile
            p, i = entry
            c = p.children[i]
            if c.finish_reason is not None:
                continue
            touched.setdefault(p.request_id, p)
            if p.metrics.first_token_time is None and out.new_token_ids:
                p.metrics.first_token_time = now
            if i == 0 and out.num_cached_tokens:
                p.num_cached_tokens = out.num_cached_tokens
            if out.prompt_logprobs is not None and p.prompt_logprobs is None:
                p.prompt_logprobs = [None if d is None else self._ranked(d)
                                     for d in out.prompt_logprobs]
            if self._add_tokens(c, out) and out.finish_reason is None:
                to_abort.append(c.request_id)  # a stop string: the engine need not go on
            if out.finish_reason is not None and c.finish_reason is None:
                c.finish_reason = out.finish_reason
                c.stop_reason = out.stop_reason
                if out.error:
                    p.error = out.error
            if c.finish_reason is not None:
                ended.add(p.request_id)
        return [self._output(p) for p in touched.values()
                if not p.quiet or not p.reported or p.request_id in ended], to_abort

    def finish(self, request_id: str, reason: str, error: str | None = None
               ) -> RequestOutput | None:
        """End every unfinished child of a request from outside the engine (abort, a dead
        worker that cannot be replaced)."""
        p = self.parents.get(request_id)
        if p is None:
            return None
        for c in p.children:
            if c.finish_reason is None:
                c.finish_reason = reason
        p.error = error or p.error
        return self._output(p)

    def _add_tokens(self, c: _Child, out: EngineCoreOutput) -> bool:
        """Append tokens (and logprobs); True when a stop string ended the completion."""
        for k, tok in enumerate(out.new_token_ids):
            c.token_ids.append(tok)
            if c.want_logprobs and out.new_logprobs is not None:
                lp = out.new_logprobs[k]
                c.logprobs.append(lp if c.raw_logprobs else self._ranked(lp))
                c.cum_logprob += lp[tok]
            if c.incremental:
                hit = c.detok.add_token(tok)
                if hit is not None:
                    c.finish_reason, c.stop_reason = "stop", hit
                    return True
        return False

    def _ranked(self, lp: dict[int, float]) -> dict[int, Logprob]:
        ranked = sorted(lp.items(), key=lambda kv: -kv[1])
        return {t: Logprob(v, r + 1, token_text(self.tokenizer, t, self._texts))
                for r, (t, v) in enumerate(ranked)}

    def _output(self, p: _Parent) -> RequestOutput:
        p.reported = True
        comps = []
        for i, c in enumerate(p.children):
            finished = c.finish_reason is not None
            if finished and not c.incremental:
                c.detok.add_tokens(c.token_ids)  # the only decode of this completion
                c.incremental = True
            delta_ids = c.token_ids[c.sent_tokens:]
            if c.raw_logprobs:
                delta_lps, c.logprobs = (c.logprobs if c.want_logprobs else None), []
            else:
                delta_lps = c.logprobs[c.sent_tokens:] if c.want_logprobs else None
            c.sent_tokens = len(c.token_ids)
            finished_now = finished and not c.finish_sent
            c.finish_sent = finished
            # NOTE: the child's own lists, not copies: a copy per step is quadratic in the
            # output's length (a 4,000-token page: ~8M element copies, docs/performance.md)
            comps.append(CompletionOutput(
                index=i, text=c.detok.text, token_ids=c.token_ids,
                cumulative_logprob=c.cum_logprob if c.want_logprobs else None,
                logprobs=c.logprobs if c.want_logprobs and not c.raw_logprobs else None,
                finish_reason=c.finish_reason, stop_reason=c.stop_reason,
                text_delta=c.detok.pop_delta(finished) if c.incremental else "",
                token_ids_delta=delta_ids, logprobs_delta=delta_lps, finished_now=finished_now))
        done = p.finished
        p.metrics.num_generation_tokens = sum(len(c.token_ids) for c in p.children)
        if done:
            p.metrics.finished_time = time.monotonic()
            self.drop(p.request_id)
        return RequestOutput(p.request_id, p.prompt, p.prompt_token_ids, comps, done,
                             num_cached_tokens=p.num_cached_tokens, metrics=p.metrics,
                             error=p.error, prompt_logprobs=p.prompt_logprobs)
