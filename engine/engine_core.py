"""EngineCore: the token-level engine every worker runs (schedule -> run -> update).

It sees single-completion requests (the API process fans ``n > 1`` out into children)
and speaks token ids only: detokenization, stop strings and response shapes live with the
caller (``engine/output_processor.py``, run in the API process or in-process by
``LLMEngine``). What each pool adds on top (hand-off after prefill, KV import, embeddings
from an encode worker) goes through the same request object and scheduler.

    step():  schedule  ->  runner.execute  ->  scheduler.update_from_output  ->  outputs
                               | raises?
                               v
             bisect the batch: re-run halves, keep the results of the halves that work,
             fail only the request(s) that still fail alone (never the bystanders)
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any

import torch
from triptych.config import EngineConfig, parse_size
from triptych.engine.encoder_cache import EncoderCache
from triptych.engine.encoder_runner import EncoderRunner
from triptych.engine.kv_cache_manager import KVCacheManager
from triptych.engine.model_runner import ModelRunner
from triptych.engine.outputs import EngineCoreOutput
from triptych.engine.request import MMItem, Request, RequestStatus
from triptych.engine.sampling_params import SamplingParams
from triptych.engine.scheduler import Scheduler, SchedulerOutput
from triptych.engine.timings import RequestTimings
from triptych.parallel.group import start_group
from triptych.engine.validate import validate_request
from triptych.kernels import get_ops, resolve_backend
from triptych.parallel.context import TPGroupError

logger = logging.getLogger("triptych.engine")


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device, checkpoint_dtype: Any) -> torch.dtype:
    if dtype == "auto":
        if device.type == "cpu":
            return torch.float32  # CPU bf16 matmuls are slow and the oracle runs fp32
        if isinstance(checkpoint_dtype, torch.dtype) and checkpoint_dtype != torch.float32:
            return checkpoint_dtype
        return torch.bfloat16
    try:
        return {"float32": torch.float32, "float": torch.float32, "bfloat16": torch.bfloat16,
                "float16": torch.float16, "half": torch.float16}[dtype]
    except KeyError:
        raise ValueError(f"unknown dtype {dtype!r}: use auto, float32, bfloat16 or float16") from None


def resolve_max_model_len(config: EngineConfig, max_position_embeddings: int) -> int:
    """The knob, or the checkpoint's positions capped at 8192 (CPU-friendly default)."""
    return config.max_model_len or min(max_position_embeddings, 8192)


def num_kv_blocks(config: EngineConfig, shape: ModelShape, dtype: torch.dtype,
                  device: torch.device, tp_size: int = 1) -> int:
    """KV blocks of one engine: ``num_kv_blocks``, else what the memory budget holds.

    A block of a tensor-parallel group is split over its ranks by KV heads (replicated when
    heads are fewer than ranks). On CUDA each rank's device has its own budget; on the CPU
    the ranks share the host, so kv_cache_memory is the whole group's."""
    if config.num_kv_blocks:
        return config.num_kv_blocks
    from triptych.models.tp_plan import local_kv_heads

    elem = torch.tensor([], dtype=dtype).element_size()
    heads = local_kv_heads(shape.num_kv_heads, tp_size)
    per_block = 2 * shape.num_layers * config.block_size * heads * shape.head_dim * elem
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        budget = int(total * config.gpu_memory_utilization) - (total - free) - (1 << 30)
    else:
        budget = parse_size(config.kv_cache_memory)
        per_block *= tp_size
    n = budget // per_block
    if n < 2:
        raise ValueError(f"KV cache budget {budget} bytes holds no blocks ({per_block} bytes "
                         "each): raise kv_cache_memory or gpu_memory_utilization")
    return int(n)


@dataclass(frozen=True)
class ModelShape:
    """What the engine needs to know about the language model, read once from config."""

    num_layers: int
    num_kv_heads: int
    head_dim: int
    max_position_embeddings: int
    spatial_merge_size: int
    tokens_per_second: float | None
    image_token_id: int
    video_token_id: int
    vocab_size: int
    hidden_size: int

    @classmethod
    def from_hf(cls, hf: Any) -> ModelShape:
        text = getattr(hf, "text_config", None) or hf
        vision = hf.vision_config
        heads = text.num_attention_heads
        return cls(
            num_layers=text.num_hidden_layers,
            num_kv_heads=text.num_key_value_heads,
            head_dim=getattr(text, "head_dim", None) or text.hidden_size // heads,
            max_position_embeddings=text.max_position_embeddings,
            spatial_merge_size=vision.spatial_merge_size,
            tokens_per_second=getattr(vision, "tokens_per_second", None),
            image_token_id=hf.image_token_id,
            video_token_id=hf.video_token_id,
            vocab_size=text.vocab_size,
            hidden_size=text.hidden_size,
        )


class EngineCore:
    """Model + KV cache + scheduler + encoder of one worker; token ids in and out."""

    def __init__(self, config: EngineConfig, eos_token_id: int | None = None,
                 data_kind: str = "", key_name: str | None = None) -> None:
        """``data_kind`` / ``key_name``: a pool worker's transport (and CURVE key) for its
        tensor-parallel ranks' KV endpoints (rank to rank between groups)."""
        from transformers import AutoConfig
        from triptych.models import compute_mrope_positions

        self.config = config
        self.device = resolve_device(config.device)
        self._mrope = compute_mrope_positions
        backend = resolve_backend(config.attention_backend, self.device.type)
        hf = AutoConfig.from_pretrained(config.model, local_files_only=True)
        self.dtype = resolve_dtype(config.dtype, self.device, getattr(hf, "dtype", None))
        self.shape = ModelShape.from_hf(hf)
        self.max_model_len = resolve_max_model_len(config, self.shape.max_position_embeddings)
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"with chunked prefill disabled, max_num_batched_tokens "
                f"({config.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len})")
        self.eos_token_id = eos_token_id
        # tensor_parallel_size > 1: this process is rank 0 of a group it starts here
        self.group = start_group(config, hf, "engine", self.device, data_kind, key_name)
        try:
            self._load(config, backend)
        except BaseException:
            self.close()
            raise
        elem = torch.tensor([], dtype=self.dtype).element_size()
        # one block of every layer, K and V, all KV heads (a group's ranks hold a slice each)
        self.block_bytes = (2 * self.shape.num_layers * config.block_size * self.shape.num_kv_heads
                            * self.shape.head_dim * elem)
        self.kv = KVCacheManager(self.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.kv, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len, enable_chunked_prefill=config.enable_chunked_prefill)
        self.attention_backend = backend
        self.hidden_size = self.shape.hidden_size
        self.last_preempted: list[str] = []  # request ids the last step preempted
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self.num_failed_steps = 0  # steps whose batch had to be bisected
        self.timings = RequestTimings()
        logger.info("engine ready: %s on %s (%s, %s attention), %d KV blocks of %d tokens, "
                    "max_model_len %d%s", config.model, self.device, self.dtype, backend,
                    self.num_blocks, config.block_size, self.max_model_len,
                    f", {config.tensor_parallel_size} tensor-parallel ranks" if self.group else "")

    def _load(self, config: EngineConfig, backend: str) -> None:
        """Model, KV block count, encoder runner and model runner: this process's own, or
        rank 0's part of the group's (the other ranks load theirs in parallel/rank.py)."""
        from triptych.models import load_model
        from triptych.models.tp_plan import local_kv_heads

        g = self.group
        self.model, self.hf_config = load_model(
            config.model, self.dtype, str(self.device), backend, tp=g.ctx if g else None,
            shard_vision=g is None or g.encoder_mode == "weights", cpu_gemm=config.cpu_gemm)
        tp = config.tensor_parallel_size
        self.num_blocks = num_kv_blocks(config, self.shape, self.dtype, self.device, tp)
        cache = EncoderCache(config.encoder_cache_size)
        kw: dict[str, Any] = {
            "num_blocks": self.num_blocks, "block_size": config.block_size,
            "num_layers": self.shape.num_layers, "head_dim": self.shape.head_dim,
            "dtype": self.dtype, "device": self.device, "ops": get_ops(backend),
            "seed": config.seed}
        if g is None:
            self.encoder = EncoderRunner(self.model.encode_images, cache, self.device, self.dtype)
            self.runner = ModelRunner(self.model, self.encoder,
                                      num_kv_heads=self.shape.num_kv_heads, **kw)
            return
        from triptych.parallel.runner import TPEncoder, TPModelRunner

        kw["num_blocks"] = self.num_blocks = g.ctx.min_int(self.num_blocks)  # ranks agree
        self.encoder = EncoderRunner(TPEncoder(g, self.model, self.shape.hidden_size, self.dtype),
                                     cache, self.device, self.dtype)
        self.runner = TPModelRunner(g, self.model, self.encoder,
                                    num_kv_heads=local_kv_heads(self.shape.num_kv_heads, tp),
                                    num_kv_heads_total=self.shape.num_kv_heads, **kw)

    def close(self) -> None:
        """Stop the tensor-parallel ranks (nothing to do for a single-process engine)."""
        if self.group is not None:
            self.group.close()

    # -- requests ---------------------------------------------------------------------------
    def check_request(self, prompt_token_ids: list[int], params: SamplingParams,
                      mm_items: list[MMItem], output_token_ids: list[int] | None = None
                      ) -> tuple[torch.Tensor, int]:
        """Validate a request fully before it joins a batch; return its M-RoPE positions and
        delta. Raises ValueError naming the problem (the request is refused, nothing else)."""
        params.verify()
        validate_request(prompt_token_ids, mm_items, self.shape, self.max_model_len,
                         self.shape.vocab_size)
        outs = output_token_ids or []
        if outs and (min(outs) < 0 or max(outs) >= self.shape.vocab_size):
            raise ValueError(f"output token ids must be in [0, {self.shape.vocab_size})")
        n = len(prompt_token_ids) + len(outs)
        if n >= self.max_model_len:
            raise ValueError(f"the request holds {n} tokens but max_model_len is "
                             f"{self.max_model_len}")
        positions, delta = self._mrope(len(prompt_token_ids), mm_items,
                                       self.shape.spatial_merge_size, self.shape.tokens_per_second)
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
    def step(self) -> list[EngineCoreOutput]:
        sched = self.scheduler.schedule()
        self.last_preempted = sched.preempted_ids
        if sched.empty:
            return []
        self.timings.on_step(sched)
        block_ids = {r.request_id: self.kv.block_ids(r.request_id) for r, _ in sched.scheduled}
        try:
            sampled, logprobs = self.runner.execute(sched, block_ids)
            failed: list[Request] = []
        except TPGroupError:
            raise  # the group is out of step: the worker stops, the supervisor restarts it
        except Exception:
            logger.exception("a step of %d requests failed; isolating the cause",
                             len(sched.scheduled))
            self.num_failed_steps += 1
            sched, sampled, logprobs, failed = self._isolate(sched, block_ids)
        produced = self.scheduler.update_from_output(sched, sampled)
        self.generation_tokens_total += len(produced)
        outs = [self._output(req, logprobs.get(req.request_id)) for req in produced]
        for req in failed:
            logger.error("request %s failed alone and is ended with an error", req.request_id)
            self.scheduler.finish(req, RequestStatus.FINISHED_ERROR)
            outs.append(EngineCoreOutput(req.request_id, [], finish_reason="error",
                                         error="internal error while computing this request"))
        for out in outs:
            if out.finish_reason is not None:
                self.runner.sampler.forget(out.request_id)
        return outs

    def _isolate(self, sched: SchedulerOutput, block_ids: dict[str, list[int]]
                 ) -> tuple[SchedulerOutput, dict[str, int], dict[str, Any], list[Request]]:
        """Bisect a failed batch: run halves, recurse into the halves that fail. Returns the
        schedule of the requests that ran, their samples, and the requests failing alone."""
        ok: list[tuple[Request, int]] = []
        sampled: dict[str, int] = {}
        logprobs: dict[str, Any] = {}
        failed: list[Request] = []
        todo = [sched.scheduled]
        while todo:
            part = todo.pop()
            try:
                s, lp = self.runner.execute(
                    SchedulerOutput(part, sum(n for _, n in part)), block_ids)
            except TPGroupError:
                raise
            except Exception:
                if len(part) == 1:
                    failed.append(part[0][0])
                else:
                    half = len(part) // 2
                    todo += [part[half:], part[:half]]
                continue
            ok += part
            sampled.update(s)
            logprobs.update(lp)
        order = {r.request_id: i for i, (r, _) in enumerate(sched.scheduled)}
        ok.sort(key=lambda rn: order[rn[0].request_id])
        return SchedulerOutput(ok, sum(n for _, n in ok)), sampled, logprobs, failed

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

    # -- hand-off (prefill worker) and import (decode worker) -------------------------------
    def export_kv(self, request_id: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """KV of a handed-off request, per layer ``[num_blocks, block_size, Hkv, D]`` each,
        then release its blocks (the copy is the transfer's end)."""
        ids = [b.block_id for b in self.kv.handed_off.get(request_id, [])]
        if not ids:
            raise KeyError(f"no handed-off KV for request {request_id!r}")
        data = self.runner.read_blocks(ids)  # [L, 2, n, block_size, Hkv, D]
        self.kv.release_blocks(request_id)
        return [(layer[0], layer[1]) for layer in data]

    def import_request(self, request_id: str, prompt_token_ids: list[int], first_token: int,
                       params: SamplingParams, kv: list[tuple[torch.Tensor, torch.Tensor]],
                       mm_items: list[MMItem] | None = None) -> Request:
        """Admit a request whose prompt KV was computed elsewhere (a decode worker).

        ``kv`` is what ``export_kv`` returned; ``first_token`` the prefill worker's sample."""
        mm_items = [MMItem(it.modality, it.mm_hash, it.offset, it.length, it.grid_thw, None,
                           it.second_per_grid_t) for it in (mm_items or [])]
        positions, delta = self.check_request(prompt_token_ids, params, mm_items, [first_token])
        n_blocks = -(-len(prompt_token_ids) // self.config.block_size)
        if len(kv) != self.shape.num_layers or any(
                k.shape != (n_blocks, *self.runner.kv_block_shape) for k, _ in kv):
            raise ValueError("imported KV does not match this model's cache layout")
        if not self.kv.pool.can_allocate(n_blocks):
            raise RuntimeError("no free KV blocks for the imported request; retry later")
        req = Request(request_id, list(prompt_token_ids), params, mm_items,
                      eos_token_id=self.eos_token_id, mrope_positions=positions,
                      mrope_delta=delta, num_computed_tokens=len(prompt_token_ids))
        req.output_token_ids.append(first_token)
        req.num_resumed_tokens = 1
        blocks = self.kv.pool.allocate(n_blocks)
        self.runner.write_blocks([b.block_id for b in blocks],
                                 torch.stack([torch.stack((k, v)) for k, v in kv]))
        self.scheduler.add_prefilled_request(req, [b.block_id for b in blocks])
        return req

    # -- observability ------------------------------------------------------------------------
    def stats(self) -> dict[str, float]:
        """Gauges and counters, named as the Prometheus metrics (without the prefix)."""
        return {
            "num_requests_running": len(self.scheduler.running),
            "num_requests_waiting": len(self.scheduler.waiting),
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
            **self.timings.stats(),
        }

