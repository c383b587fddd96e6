"""EngineCore: the token-level engine every worker runs (schedule -> run -> update).

It sees single-completion requests (the API process fans ``n > 1`` out into children)
and speaks token ids only: detokenization, stop strings and response shapes live with the
caller (``router/output_processor.py``, run in the API process or in-process by
``LLMEngine``). What each pool adds on top (hand-off after prefill, KV import, embeddings
from an encode worker) goes through the same request object and scheduler. The model and
its runner come built (``parallel/loader.py``: one process, or rank 0 of a group), so the
engine never starts processes itself.

    step():  schedule  ->  runner.execute  ->  scheduler.update_from_output  ->  outputs
                               | raises?
                               v
             bisect the batch: re-run halves, keep the results of the halves that work,
             fail only the request(s) that still fail alone (never the bystanders)

    async:   schedule N+1 -> prepare + sample N+1 -> collect N (the wait) -> update N
             (the device runs N+1 while the host handles N: outputs lag one step)
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

import torch
from triptych.config import EngineConfig
from triptych.engine.kv.kv_cache_manager import KVCacheManager
from triptych.engine.loaded_model import LoadedModel
from triptych.engine.outputs import EngineCoreOutput
from triptych.engine.request import MMItem, Request, RequestStatus
from triptych.engine.runner.model_runner import ModelRunner, RunnerBroken, StepOutput
from triptych.engine.sample.sampling_params import SamplingParams
from triptych.engine.scheduler import Scheduler, SchedulerOutput
from triptych.engine.sizing.model_shape import (  # noqa: F401 (ModelShape, resolve_*: re-exported)
    ModelShape,
    kv_block_bytes,
    num_kv_blocks,
    resolve_device,
    resolve_dtype,
    resolve_max_model_len,
)
from triptych.engine.structured.grammar_compiler import GrammarCompiler
from triptych.engine.timings import RequestTimings
from triptych.engine.validate import validate_request

logger = logging.getLogger("triptych.engine")


@dataclass
class StepResult:
    """What one ``EngineCore.step`` did."""

    outputs: list[EngineCoreOutput] = field(default_factory=list)  # one per request that
    # produced a token or ended this step
    preempted: list[Request] = field(default_factory=list)  # requests this step's schedule
    # preempted: back in the waiting queue, their KV freed (a worker that cannot recompute
    # one here hands it back)


class EngineCore:
    """Model + KV cache + scheduler + encoder of one worker; token ids in and out."""

    def __init__(self, config: EngineConfig, loaded: LoadedModel,
                 eos_token_id: int | None = None) -> None:
        """``loaded``: the model and runners ``parallel.loader.load_for_role(config,
        "engine")`` built (one process, or rank 0 of a group); the core owns them from here
        and closes them in ``close``."""
        from triptych.models.contract import contract_for

        assert loaded.runner is not None, "the engine core runs the engine role's model"
        self.config = config
        self.loaded = loaded
        self.model, self.hf_config, self.shape = loaded.model, loaded.hf_config, loaded.shape
        self.device, self.dtype = loaded.device, loaded.dtype
        self.attention_backend = loaded.attention_backend
        self.max_model_len = loaded.max_model_len
        self.encoder = loaded.encoder
        self.runner: ModelRunner = loaded.runner
        self.num_blocks = loaded.num_blocks
        self.group = loaded.group  # rank 0's tensor-parallel group, or None
        self._contract = contract_for(self.hf_config)  # prompt positions (M-RoPE kind)
        self.eos_token_id = eos_token_id
        # one block of every layer, K and V, all KV heads (a group's ranks hold a slice each)
        self.block_bytes = kv_block_bytes(self.shape, config.block_size, self.dtype)
        self.kv = KVCacheManager(self.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.kv, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len, enable_chunked_prefill=config.enable_chunked_prefill,
            tenant_step_share=config.tenant_step_share)
        self.hidden_size = self.shape.hidden_size
        self.payload_width = self.shape.payload_width  # an encoder payload's columns
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.num_failed_steps = 0  # steps whose batch had to be bisected
        self.timings = RequestTimings()
        # Structured output: grammars compile on the compiler's threads, not in a step; the
        # batch's matchers take them from its cache (the tokenizer loads on first use).
        self.grammars = GrammarCompiler(None, self.shape.vocab_size, eos_token_id,
                                        load=lambda: _load_tokenizer(config))
        self.runner.batch.grammars.compile = self.grammars.compile
        self.runner.batch.grammars.budget.fixed_s = config.max_grammar_step_ms / 1000
        # Async scheduling (vLLM's --async-scheduling): the next step is prepared while the
        # device runs this one. Default: on CUDA, where there is a device to overlap with.
        want = config.async_scheduling
        self.async_scheduling = self.runner.supports_async and (
            want if want is not None else self.device.type == "cuda")
        if want and not self.runner.supports_async:
            logger.info("async scheduling is off: a tensor-parallel group's ranks take each "
                        "step's token ids from rank 0's host arrays")
        self._inflight: Any = None  # the step whose ids are not read yet (async)
        self.num_ordered_steps = 0  # async steps whose sampling waited for the previous step
        logger.info("engine ready: %s on %s (%s, %s attention), %d KV blocks of %d tokens, "
                    "max_model_len %d%s", config.model, self.device, self.dtype,
                    self.attention_backend, self.num_blocks, config.block_size,
                    self.max_model_len,
                    f", {loaded.tp_size} tensor-parallel ranks" if self.group else "")

    def close(self) -> None:
        """Stop the tensor-parallel ranks (nothing to do for a single-process engine)."""
        self.grammars.close()
        self.loaded.close()

    # -- requests ---------------------------------------------------------------------------
    def check_request(self, prompt_token_ids: list[int], params: SamplingParams,
                      mm_items: list[MMItem], output_token_ids: list[int] | None = None
                      ) -> tuple[torch.Tensor, int]:
        """Validate a request fully before it joins a batch; return its M-RoPE positions and
        delta. Raises ValueError naming the problem (the request is refused, nothing else)."""
        params.verify()
        if params.structured_outputs is not None:  # start compiling (cached): the caller
            self.grammars.submit(params.structured_outputs)  # waits before it admits
        validate_request(prompt_token_ids, mm_items, self.shape, self.max_model_len,
                         self.shape.vocab_size)
        outs = output_token_ids or []
        if outs and (min(outs) < 0 or max(outs) >= self.shape.vocab_size):
            raise ValueError(f"output token ids must be in [0, {self.shape.vocab_size})")
        n = len(prompt_token_ids) + len(outs)
        if n >= self.max_model_len:
            raise ValueError(f"the request holds {n} tokens but max_model_len is "
                             f"{self.max_model_len}")
        # NOTE: a prompt that needs more blocks than the pool holds would wait for room
        # forever; refuse it here, naming the knob (a P+D prefill worker's default is small).
        blocks = -(-(n + 1) // self.config.block_size)
        if blocks > self.num_blocks:
            raise ValueError(f"the request needs {blocks} KV blocks but this worker's KV cache "
                             f"holds {self.num_blocks}: raise --kv-cache-memory (or "
                             "--num-kv-blocks) or send a shorter prompt")
        positions, delta = self._contract.positions(len(prompt_token_ids), mm_items,
                                                    self.hf_config)
        # Video frame spacing can push M-RoPE positions past the token count (and past
        # the rotary table): refuse rather than index out of range later.
        last = min(self.max_model_len,
                   len(prompt_token_ids) + (params.max_tokens or self.max_model_len)) - 1
        max_pos = max(int(positions.max()), last + delta)
        if max_pos >= self.shape.max_position_embeddings:
            raise ValueError(f"the prompt's M-RoPE positions reach {max_pos}, beyond the model's "
                             f"{self.shape.max_position_embeddings} positions; use a shorter "
                             "video (fewer frames) or a lower max_model_len")
        return positions, delta

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    mm_items: list[MMItem] | None = None, *, hand_off_after_prefill: bool = False,
                    output_token_ids: list[int] | None = None) -> Request:
        """Queue one completion. ``output_token_ids``: tokens already produced elsewhere (a
        request resumed after its worker died); they are recomputed like a preempted
        request's and never emitted again. Raises ValueError on bad input."""
        if params.n != 1:
            raise ValueError("the engine core takes one completion per request (n=1)")
        if request_id in self.scheduler.requests:
            raise ValueError(f"request id {request_id!r} is already in use")
        mm_items = mm_items or []
        positions, delta = self.check_request(prompt_token_ids, params, mm_items,
                                              output_token_ids)
        if params.structured_outputs is not None:  # (a worker waited for it: a cache hit)
            self.grammars.compile(params.structured_outputs)  # ValueError: refused
        req = Request(request_id, list(prompt_token_ids), params, mm_items,
                      eos_token_id=self.eos_token_id, mrope_positions=positions,
                      mrope_delta=delta, hand_off_after_prefill=hand_off_after_prefill)
        req.output_token_ids = list(output_token_ids or [])
        req.num_resumed_tokens = len(req.output_token_ids)
        req.prompt_logprobs_sent = bool(req.output_token_ids)  # sent by an earlier attempt
        self.scheduler.add_request(req)
        self.prompt_tokens_total += len(prompt_token_ids)
        return req

    def abort(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            req = self.scheduler.requests.get(rid)
            if req is not None:
                self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
            self.runner.sampler.forget(rid)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # -- the loop -----------------------------------------------------------------------------
    def step(self) -> StepResult:
        """One step: schedule -> run -> update. Returns the outputs and the preempted.

        With async scheduling the step's forward is launched before the previous step's
        ids are read, and its outputs are those of the previous step (``_step_async``)."""
        sched = self.scheduler.schedule()
        result = StepResult(preempted=sched.preempted)
        if self.async_scheduling:
            result.outputs = self._step_async(sched)
            return result
        if sched.empty:
            return result
        self.timings.on_step(sched)
        result.outputs = self._run_sync(sched)
        return result

    def _run_sync(self, sched: SchedulerOutput) -> list[EngineCoreOutput]:
        try:
            out, failed = self.runner.execute(sched), []
        except RunnerBroken:
            raise  # e.g. a tensor-parallel group out of step: the worker stops and restarts
        except Exception:
            logger.exception("a step of %d requests failed; isolating the cause",
                             len(sched.scheduled))
            self.num_failed_steps += 1
            sched, out, failed = self._isolate(sched)
        return self._update(sched, out, failed)

    def _step_async(self, sched: SchedulerOutput) -> list[EngineCoreOutput]:
        """Async scheduling (vLLM's): while the device runs step N+1, the host reads step
        N's ids and processes them; the only wait is that read.

            host:   schedule N+1 | prepare N+1 | sample N+1 | collect N (wait) | update N
            device:   ... N  ...   | forward N+1 ............ sampling N+1 ...

        A step whose sampling needs a token of step N (a grammar or penalised row: its
        bitmask or counts) samples after collecting N, its bitmask filled while its forward
        runs. A failed step is isolated synchronously, after N is collected."""
        prev, self._inflight = self._inflight, None
        outs: list[EngineCoreOutput] = []
        if sched.empty:
            return self._complete(prev) if prev is not None else outs
        self.timings.on_step(sched)
        try:
            pending = self.runner.prepare(sched)
            if prev is not None and pending.needs_previous:
                outs, prev = self._complete(prev), None
                self.num_ordered_steps += 1
            self._inflight = self.runner.sample(pending)
        except RunnerBroken:
            raise
        except Exception:
            logger.exception("a step of %d requests failed; isolating the cause",
                             len(sched.scheduled))
            self.num_failed_steps += 1
            self.runner.drop_in_flight(keep=prev)
            if prev is not None:
                outs, prev = outs + self._complete(prev), None
            isolated, out, failed = self._isolate(sched)
            return outs + self._update(isolated, out, failed)
        if prev is not None:
            outs += self._complete(prev)
        return outs

    def _complete(self, f: Any) -> list[EngineCoreOutput]:
        """Read an in-flight step's ids (the wait) and apply them."""
        return self._update(f.sched, self.runner.collect(f), [])

    def _update(self, sched: SchedulerOutput, out: StepOutput, failed: list[Request]
                ) -> list[EngineCoreOutput]:
        """A run step's results into the scheduler, as outputs."""
        sampled, logprobs = out.sampled, out.logprobs
        # a grammar that allowed no token, or that cost more than its share of the step:
        # the token sampled without its mask is not the request's, and it is ended
        dead = [(r, out.dead[r.request_id]) for r, _ in sched.scheduled
                if r.request_id in out.dead and sampled.pop(r.request_id, None) is not None]
        produced = self.scheduler.update_from_output(sched, sampled)
        self.generation_tokens_total += len(produced)
        self.timings.on_step_outputs(produced)
        outs = [self._output(req, logprobs.get(req.request_id)) for req in produced]
        for req in failed:
            logger.error("request %s failed alone and is ended with an error", req.request_id)
            self.scheduler.finish(req, RequestStatus.FINISHED_ERROR)
            outs.append(EngineCoreOutput(req.request_id, [], finish_reason="error",
                                         error="internal error while computing this request"))
        for req, why in dead:
            if req.finished:
                continue  # (ended meanwhile)
            self.scheduler.finish(req, RequestStatus.FINISHED_ERROR)
            outs.append(EngineCoreOutput(req.request_id, [], finish_reason="error", error=why))
        for o in outs:
            if o.finish_reason is not None:
                self.runner.sampler.forget(o.request_id)
        return outs

    def _isolate(self, sched: SchedulerOutput
                 ) -> tuple[SchedulerOutput, StepOutput, list[Request]]:
        """Bisect a failed batch: run halves, recurse into the halves that fail. Returns the
        schedule of the requests that ran, their results, and the requests failing alone."""
        ok: list[tuple[Request, int]] = []
        total = StepOutput()
        failed: list[Request] = []
        todo = [sched.scheduled]
        while todo:
            part = todo.pop()
            try:
                got = self.runner.execute(sched.subset(part))
            except RunnerBroken:
                raise
            except Exception:
                if len(part) == 1:
                    failed.append(part[0][0])
                else:
                    half = len(part) // 2
                    todo += [part[half:], part[:half]]
                continue
            ok += part
            total.sampled.update(got.sampled)
            total.logprobs.update(got.logprobs)
            total.dead.update(got.dead)
        order = {r.request_id: i for i, (r, _) in enumerate(sched.scheduled)}
        ok.sort(key=lambda rn: order[rn[0].request_id])
        return sched.subset(ok), total, failed

    def _output(self, req: Request, logprobs: dict[int, float] | None) -> EngineCoreOutput:
        self.timings.on_token(req)
        status = req.status
        reason = status.finish_reason if status.finished else None
        stop = req.stop_reason if isinstance(req.stop_reason, int) else None
        prompt_lps = None
        if req.sampling_params.prompt_logprobs is not None and not req.prompt_logprobs_sent:
            req.prompt_logprobs_sent = True  # the prompt is all computed: it sampled
            prompt_lps = [None] + [req.prompt_logprobs.get(t)
                                   for t in range(1, req.num_prompt_tokens)]
        return EngineCoreOutput(req.request_id, [req.output_token_ids[-1]],
                                None if logprobs is None else [logprobs], reason, stop,
                                req.num_cached_tokens, prompt_logprobs=prompt_lps)

    # -- observability ------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        """Gauges and counters, named as the Prometheus metrics (without the prefix)."""
        return {
            "num_requests_running": len(self.scheduler.running),
            "num_requests_waiting": len(self.scheduler.waiting) + len(self.scheduler.prefilled),
            "kv_cache_usage_perc": self.kv.usage,
            "num_preemptions_total": self.scheduler.num_preemptions_total,
            "prompt_tokens_total": self.prompt_tokens_total,
            "generation_tokens_total": self.generation_tokens_total,
            "prefix_cache_hits": self.kv.num_prefix_hits,
            "prefix_cache_queries": self.kv.num_prefix_queries,
            "encoder_cache_hits": self.encoder.cache.num_hits,
            "encoder_cache_queries": self.encoder.cache.num_queries,
            "encoder_cache_usage_bytes": self.encoder.cache.num_bytes,
            "encoder_cache_capacity_bytes": self.encoder.cache.capacity_bytes,
            "prefix_cache_usage_bytes": self.kv.pool.num_cached_blocks * self.block_bytes,
            "prefix_cache_capacity_bytes": self.num_blocks * self.block_bytes,
            "num_gpu_blocks": self.num_blocks,
            "failed_steps_total": self.num_failed_steps,
            "tenant_share_deferrals_total": self.scheduler.shares.deferrals_total,
            **self.timings.stats(),
        }


def _load_tokenizer(config: EngineConfig) -> Any:
    """The checkpoint's tokenizer (structured output builds its token table from it)."""
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(config.tokenizer or config.model, local_files_only=True)
