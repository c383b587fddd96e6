"""The unified token-budget scheduler (no prefill/decode phases, vLLM v1 style).

Each step every running request gets the tokens it still needs (one for a decode, the
rest of its prompt - or a chunk of it - for a prefill) within ``max_num_batched_tokens``.
Decodes are served first so long prompts never stall streaming requests; then partial
prefills; then waiting requests are admitted while budget, seats and blocks last.
When blocks run out the most recently admitted running request is preempted: its blocks
are freed and it recomputes from scratch later (prefix caching usually makes that cheap).

Counters move when a step is scheduled, as vLLM v1's: ``num_computed_tokens`` counts the
tokens whose KV is written or on its way (a scheduled step), and a step that will sample a
request gives it an output placeholder. So the next step can be scheduled while this one
runs (async scheduling, engine/engine_core.py): a decode whose last token is still on
the device is scheduled again at that token's position (the runner takes its value from
the device), and ``update_from_output`` later fills the placeholder with the token:

    request: 10 prompt tokens, decoding          computed  tokens  placeholders
    schedule step N   (1 token, samples)             10        10        1
    schedule step N+1 (the token of N, on device)    11        10        2
    update N: token t appended                       11        11        1
    update N+1: u appended (or dropped: N stopped)   11        12        0

A request is not scheduled past what it may still produce (max_tokens, max_model_len
counting its placeholders); one that stops at step N's token has step N+1's dropped.
"""
from __future__ import annotations

import logging
from collections import Counter, deque
from dataclasses import dataclass, field

from triptych.engine.kv.kv_cache_manager import KVCacheManager
from triptych.engine.request import Request, RequestStatus
from triptych.engine.tenant_share import (Seats, StepShares, TenantShares, tenant_of,
                                          took_turn)

logger = logging.getLogger("triptych.scheduler")

PROMPT_LOGPROBS_CHUNK = 1024  # prompt tokens per step of a request asking prompt_logprobs


@dataclass
class SchedulerOutput:
    """What the scheduler tells the runner to compute this step."""

    scheduled: list[tuple[Request, int]]  # (request, num new tokens) in batch order
    num_scheduled_tokens: int  # sum of the above
    block_ids: dict[str, list[int]] = field(default_factory=dict)  # request id -> its KV
    # block table (every block it holds, in order) for each scheduled request
    preempted: list[Request] = field(default_factory=list)  # preempted during this schedule
    sampling: set[str] = field(default_factory=set)  # request ids this step samples (each
    # got an output placeholder when scheduled)

    @property
    def empty(self) -> bool:
        return not self.scheduled

    @property
    def preempted_ids(self) -> list[str]:
        return [r.request_id for r in self.preempted]

    def subset(self, scheduled: list[tuple[Request, int]]) -> SchedulerOutput:
        """The same step for some of its requests (a failed batch is bisected)."""
        return SchedulerOutput(scheduled, sum(n for _, n in scheduled),
                               {r.request_id: self.block_ids[r.request_id] for r, _ in scheduled},
                               sampling={r.request_id for r, _ in scheduled} & self.sampling)


class Scheduler:
    def __init__(self, kv: KVCacheManager, *, max_num_seqs: int, max_num_batched_tokens: int,
                 max_model_len: int, enable_chunked_prefill: bool = True,
                 tenant_step_share: float = 0.0) -> None:
        self.kv = kv
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order: the last is preempted first
        self.prefilled: deque[Request] = deque()  # KV imported (their blocks held), waiting
        # for a seat: max_num_seqs bounds the batch however a request arrived
        self.requests: dict[str, Request] = {}
        self.num_preemptions_total = 0
        self._warned_preemption = False
        self.shares = TenantShares(tenant_step_share)  # engine/tenant_share.py
        self.tenants: Counter[str] = Counter()  # unfinished requests per tenant (shares
        # cost nothing, not even a walk over the queues, while there is one)
        self.num_steps = 0

    # -- queues -------------------------------------------------------------------------
    def add_request(self, request: Request) -> None:
        self.requests[request.request_id] = request
        self.tenants[tenant_of(request)] += 1
        self.waiting.append(request)

    def add_prefilled_request(self, request: Request, block_ids: list[int]) -> None:
        """Admit a request whose KV (all but its last token) already sits in ``block_ids``
        (KV import: the prefill side computed the prompt and sampled the last token). It
        runs at once when a seat (``max_num_seqs``) is free, else at the first schedule
        that has one, before any waiting prompt (its blocks are held meanwhile)."""
        assert request.num_computed_tokens == request.num_tokens - 1
        blocks = [self.kv.pool.blocks[i] for i in block_ids]
        assert all(b.ref_cnt > 0 for b in blocks), "imported blocks must be allocated first"
        self.kv.req_blocks[request.request_id] = blocks
        request.status = RequestStatus.RUNNING
        self.requests[request.request_id] = request
        self.tenants[tenant_of(request)] += 1
        self.prefilled.append(request)
        self._seat_prefilled()

    def _seat_prefilled(self) -> None:
        """KV imports take the free seats (``max_num_seqs``), in the order they came."""
        while self.prefilled and len(self.running) < self.max_num_seqs:
            self.running.append(self.prefilled.popleft())

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
        elif request in self.prefilled:
            self.prefilled.remove(request)
        if status == RequestStatus.FINISHED_HANDED_OFF:
            self.kv.take_blocks(request)
        else:
            self.kv.free(request)
        if self.requests.pop(request.request_id, None) is not None:
            t = tenant_of(request)
            self.tenants[t] -= 1
            if self.tenants[t] <= 0:
                del self.tenants[t]

    @property
    def num_unfinished(self) -> int:
        return len(self.waiting) + len(self.running) + len(self.prefilled)

    # -- scheduling -----------------------------------------------------------------------
    def schedule(self) -> SchedulerOutput:
        self._seat_prefilled()  # seats freed since they came
        budget = self.max_num_batched_tokens
        scheduled: list[tuple[Request, int]] = []
        preempted: list[Request] = []
        shares, seats = self.shares.begin(  # (None, None: nobody is crowded out)
            self.running, self.waiting, self.tenants, self._tokens_to_compute,
            self.max_num_batched_tokens, self.max_num_seqs)
        seated: list[Request] = []  # preempted for a seat (admission goes on this step)
        if shares is not None and seats is not None:
            for victim in seats.victims(self.running, self.waiting):
                self._preempt(victim, "its tenant holds more than its part of the seats "
                                      "(max_num_seqs) while another tenant waits")
                seated.append(victim)
        # Decodes first, then running prefill chunks, each in admission order (with tenant
        # shares: tenant by tenant, in turns, none of a tenant that took its share).
        order = sorted(self.running, key=lambda r: r.num_computed_tokens < r.num_prompt_tokens) \
            if shares is None else shares.order(self.running)
        for req in order:
            if budget == 0:
                break
            if req.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this loop
            n = min(self._tokens_to_compute(req), budget)
            if n > 0 and shares is not None:
                n = shares.take(req, n, req.num_computed_tokens, self.enable_chunked_prefill)
            if n <= 0:
                continue  # all it may produce is on the device already (or not its turn)
            while self.kv.allocate_slots(req, n) is None:
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                for i, (r, m) in enumerate(scheduled):  # (scheduled earlier in this loop)
                    if r is victim:
                        del scheduled[i]
                        budget += m
                        break
                if victim is req:
                    break
            if req.status != RequestStatus.RUNNING:
                continue
            scheduled.append((req, n))
            budget -= n
        if not preempted:  # (a victim of this schedule is not admitted again in it)
            self._admit_waiting(scheduled, budget, shares, seats, seated)
        preempted = seated + preempted
        block_ids = {r.request_id: self.kv.block_ids(r.request_id) for r, _ in scheduled}
        out = SchedulerOutput(scheduled, sum(n for _, n in scheduled), block_ids, preempted)
        self.num_steps += 1
        if shares is not None:
            self.shares.deferrals_total += shares.deferred
        self.shares.scheduled(ran=bool(scheduled))
        turns = self.shares.share > 0  # (each tenant's turn order: tenant_share.took_turn,
        # ~0.15 us a sequence, kept while shares are on: they may start any step)
        for req, n in scheduled:  # (vLLM's _update_after_schedule)
            req.num_computed_tokens += n
            if turns:
                took_turn(req, self.num_steps)
            if req.num_computed_tokens == req.num_tokens + req.num_output_placeholders:
                req.num_output_placeholders += 1  # this step samples its next token
                out.sampling.add(req.request_id)
        return out

    def _tokens_to_compute(self, req: Request) -> int:
        """Tokens a running request still needs now: its uncomputed ones (placeholders
        of in-flight steps included), none when those steps already produce all it may
        (max_tokens, max_model_len) or it hands off after them; prompt-logprobs chunks
        at most PROMPT_LOGPROBS_CHUNK."""
        pending = req.num_output_placeholders
        if pending:
            sp = req.sampling_params
            if req.hand_off_after_prefill or \
                    (sp.max_tokens is not None and req.num_output_tokens + pending >= sp.max_tokens) \
                    or req.num_tokens + pending >= self.max_model_len:
                return 0
        return self._chunk(req, req.num_tokens + pending - req.num_computed_tokens)

    @staticmethod
    def _chunk(req: Request, n: int) -> int:
        """``n`` capped for a prompt whose logprobs are asked: its logits per step, [n,
        vocab] fp32 (~0.6 GB at 1,024 rows of a 152k vocab), stay what the profile run saw."""
        if req.sampling_params.prompt_logprobs is not None and \
                req.num_computed_tokens < req.num_prompt_tokens:
            return min(n, PROMPT_LOGPROBS_CHUNK)
        return n

    def _admit_waiting(self, scheduled: list[tuple[Request, int]], budget: int,
                       shares: StepShares | None, seats: Seats | None,
                       seated: list[Request]) -> None:
        passed: list[Request] = []  # over their tenant's share: others behind them go first
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if any(req is v for v in seated) or shares is not None and (
                    shares.held(req) or seats is not None and seats.lets_others_first(req)):
                passed.append(self.waiting.popleft())
                continue
            hits, num_hit_tokens = self.kv.get_computed_blocks(req)
            if req.sampling_params.prompt_logprobs is not None:
                hits, num_hit_tokens = [], 0  # every prompt position must be computed
            n = self._chunk(req, req.num_tokens - num_hit_tokens)
            if n > budget:
                if not self.enable_chunked_prefill:
                    break
                n = budget
            if shares is not None:
                n = shares.take(req, n, num_hit_tokens, self.enable_chunked_prefill)
                if n == 0:
                    passed.append(self.waiting.popleft())
                    continue
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
            if seats is not None:
                seats.admitted(req)
        self.waiting.extendleft(reversed(passed))

    def _preempt(self, req: Request, why: str = "") -> None:
        self.running.remove(req)
        self.kv.free(req)
        req.status = RequestStatus.PREEMPTED
        # NOTE: a token still on the device (a placeholder) is appended when its step
        # completes; the request is admitted again only after that (not in this schedule)
        req.num_computed_tokens = 0
        req.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(req)
        if why:  # (tenant seats: not a sign of a small cache)
            self.shares.seat_preemptions_total += 1
            logger.info("request %s was preempted: %s (--tenant-step-share)", req.request_id,
                        why)
        elif not self._warned_preemption:
            self._warned_preemption = True
            logger.warning(
                "Request %s was preempted (KV cache full; it will be recomputed). This costs "
                "throughput: raise kv_cache_memory (CPU) or gpu_memory_utilization (CUDA), or "
                "lower max_num_seqs / max_num_batched_tokens. Total preemptions: %d",
                req.request_id, self.num_preemptions_total)

    # -- after the step ---------------------------------------------------------------------
    def update_from_output(self, out: SchedulerOutput,
                           sampled: dict[str, int]) -> list[Request]:
        """Fill the step's placeholders with its sampled tokens, publish the blocks whose
        KV and tokens are known, finish on EOS/stop ids/length. A request that ended while
        the step ran (a stop at the previous step's token, an abort) drops its token.

        Returns the requests that produced a token this step (finished ones included).
        """
        produced = []
        for req, _ in out.scheduled:
            rid = req.request_id
            was_running = req.status == RequestStatus.RUNNING
            if rid in out.sampling:
                req.num_output_placeholders -= 1
            tok = sampled.get(rid)
            if req.finished:
                continue  # its token (if any) is not its own any more
            if was_running:  # (a request preempted meanwhile has no blocks)
                self.kv.cache_blocks(req, req.num_computed_tokens - req.num_output_placeholders)
            if tok is None:
                continue  # a prefill chunk short of the prompt's end (or a failed row)
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
