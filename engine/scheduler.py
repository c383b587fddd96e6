"""The unified token-budget scheduler (no prefill/decode phases, vLLM v1 style).

Each step every running request gets the tokens it still needs (one for a decode, the
rest of its prompt - or a chunk of it - for a prefill) within ``max_num_batched_tokens``.
Decodes are served first so long prompts never stall streaming requests; then partial
prefills; then waiting requests are admitted while budget, seats and blocks last.
When blocks run out the most recently admitted running request is preempted: its blocks
are freed and it recomputes from scratch later (prefix caching usually makes that cheap).
"""
from __future__ import annotations

import logging
from collections import deque
from dataclasses import dataclass, field

from triptych.engine.kv_cache_manager import KVCacheManager
from triptych.engine.request import Request, RequestStatus

logger = logging.getLogger("triptych.scheduler")


@dataclass
class SchedulerOutput:
    """What the scheduler tells the runner to compute this step."""

    scheduled: list[tuple[Request, int]]  # (request, num new tokens) in batch order
    num_scheduled_tokens: int  # sum of the above
    block_ids: dict[str, list[int]] = field(default_factory=dict)  # request id -> its KV
    # block table (every block it holds, in order) for each scheduled request
    preempted: list[Request] = field(default_factory=list)  # preempted during this schedule

    @property
    def empty(self) -> bool:
        return not self.scheduled

    @property
    def preempted_ids(self) -> list[str]:
        return [r.request_id for r in self.preempted]

    def subset(self, scheduled: list[tuple[Request, int]]) -> SchedulerOutput:
        """The same step for some of its requests (a failed batch is bisected)."""
        return SchedulerOutput(scheduled, sum(n for _, n in scheduled),
                               {r.request_id: self.block_ids[r.request_id] for r, _ in scheduled})


class Scheduler:
    def __init__(self, kv: KVCacheManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, enable_chunked_prefill: bool = True) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the last is preempted first
        self.requests: dict[str, Request] = {}
        self.num_preemptions_total = 0
        self._warned_preemption = False

    # -- queues -------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def add_prefilled_request(self, request: Request, block_ids: list[int]) -> None:
        """Admit a request whose KV (all but its last token) already sits in ``block_ids``
        (KV import: the prefill side computed the prompt and sampled the last token)."""
        assert request.num_computed_tokens == request.num_tokens - 1
        blocks = [self.kv.pool.blocks[i] for i in block_ids]
        assert all(b.ref_cnt > 0 for b in blocks), "imported blocks must be allocated first"
        self.kv.req_blocks[request.request_id] = blocks
        request.status = RequestStatus.RUNNING
        self.requests[request.request_id] = request
        self.running.append(request)

    def finish(self, request: Request, status: RequestStatus) -> None:
        """End a request and free its blocks (abort, stop string, error); a hand-off
        keeps them, held by the KV manager until ``kv.release_blocks``."""
        if request.finished:
            return
        request.status = status
        if request in self.running:
            self.running.remove(request)
        elif request in self.waiting:
            self.waiting.remove(request)
        if status == RequestStatus.FINISHED_HANDED_OFF:
            self.kv.take_blocks(request)
        else:
            self.kv.free(request)
        self.requests.pop(request.request_id, None)

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running)

    # -- scheduling -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        preempted: list[Request] = []
        # Decodes first, then running prefill chunks, each in admission order.
        order = sorted(self.running, key=lambda r: r.num_computed_tokens < r.num_prompt_tokens)
        for req in order:
            if budget == 0:
                break
            if req.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            while self.kv.allocate_slots(req, n) is None:
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                continue
            scheduled.append((req, n))
            budget -= n
        if not preempted:
            self._admit_waiting(scheduled, budget)
        block_ids = {r.request_id: self.kv.block_ids(r.request_id) for r, _ in scheduled}
        return SchedulerOutput(scheduled, sum(n for _, n in scheduled), block_ids, preempted)

    def _admit_waiting(self, scheduled: list[tuple[Request, int]], budget: int) -> None:
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            hits, num_hit_tokens = self.kv.get_computed_blocks(req)
            if req.sampling_params.prompt_logprobs is not None:
                hits, num_hit_tokens = [], 0  # every prompt position must be computed
            n = req.num_tokens - num_hit_tokens
            if n > budget:
                if not self.enable_chunked_prefill:
                    break
                n = budget
            if self.kv.allocate_slots(req, n, hits) is None:
                break  # wait for running requests to free blocks
            self.waiting.popleft()
            self.kv.record_prefix_lookup(req.num_tokens, num_hit_tokens)
            req.num_computed_tokens = num_hit_tokens
            if req.num_preemptions == 0:
                req.num_cached_tokens = num_hit_tokens
            req.status = RequestStatus.RUNNING
            self.running.append(req)
            scheduled.append((req, n))
            budget -= n

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(req)
        if not self._warned_preemption:
            self._warned_preemption = True
            logger.warning(
                "Request %s was preempted (KV cache full; it will be recomputed). This costs "
                "throughput: raise kv_cache_memory (CPU) or gpu_memory_utilization (CUDA), or "
                "lower max_num_seqs / max_num_batched_tokens. Total preemptions: %d",
                req.request_id, self.num_preemptions_total)

    # -- after the step ---------------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput,
                           sampled: dict[str, int]) -> list[Request]:
        """Advance counters, append sampled tokens, finish on EOS/stop ids/length.

        Returns the requests that produced a token this step (finished ones included).
        """
        produced = []
        for req, n in out.scheduled:
            req.num_computed_tokens += n
            self.kv.cache_blocks(req, req.num_computed_tokens)
            tok = sampled.get(req.request_id)
            if tok is None:
                continue  # a prefill chunk short of the prompt's end
            req.output_token_ids.append(tok)
            produced.append(req)
            status = self._check_stop(req, tok)
            if status is not None:
                self.finish(req, status)
        return produced

    def _check_stop(self, req: Request, tok: int) -> RequestStatus | None:
        status = self._stop_status(req, tok)
        if (status is None and req.hand_off_after_prefill
                and req.num_output_tokens == req.num_resumed_tokens + 1):
            return RequestStatus.FINISHED_HANDED_OFF
        return status

    def _stop_status(self, req: Request, tok: int) -> RequestStatus | None:
        sp = req.sampling_params
        if req.num_output_tokens >= sp.min_tokens:
            if not sp.ignore_eos and tok == req.eos_token_id:
                req.stop_reason = None
                return RequestStatus.FINISHED_STOPPED
            if sp.stop_token_ids and tok in sp.stop_token_ids:
                req.stop_reason = tok
                return RequestStatus.FINISHED_STOPPED
        if sp.max_tokens is not None and req.num_output_tokens >= sp.max_tokens:
            return RequestStatus.FINISHED_LENGTH
        if req.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None
