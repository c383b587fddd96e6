"""LLMEngine: the colocated engine (encode + prefill + decode in one process).

``step()`` is the whole loop: schedule, run, process outputs. Callers (the offline
``LLM``, the server's engine process) add requests and call ``step()`` until done.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from triptych.config import EngineConfig, parse_size
from triptych.encode import EncoderCache, EncoderRunner
from triptych.engine.detokenizer import IncrementalDetokenizer
from triptych.engine.kv_cache_manager import KVCacheManager
from triptych.engine.model_runner import ModelRunner
from triptych.engine.output_processor import OutputProcessor
from triptych.engine.outputs import RequestOutput
from triptych.engine.request import MMItem, Request, RequestStatus
from triptych.engine.sampling_params import SamplingParams
from triptych.engine.scheduler import Scheduler
from triptych.engine.threads import apply_thread_policy
from triptych.engine.validate import validate_request
from triptych.kernels import get_ops, resolve_backend

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
        )


class LLMEngine:
    def __init__(self, config: EngineConfig, tokenizer: Any | None = None) -> None:
        from triptych.models import compute_mrope_positions, load_model

        if config.tensor_parallel_size != 1 or config.data_parallel_size != 1:
            raise ValueError("tensor_parallel_size / data_parallel_size > 1 are not supported yet "
                             "by the colocated engine; run one engine per device for now")
        self.config = config
        self.cpu_threads = apply_thread_policy(config.cpu_threads)
        self.device = resolve_device(config.device)
        self._mrope = compute_mrope_positions
        backend = resolve_backend(config.attention_backend, self.device.type)
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(config.model, local_files_only=True)
        self.dtype = resolve_dtype(config.dtype, self.device, getattr(hf, "dtype", None))
        self.model, self.hf_config = load_model(config.model, self.dtype, str(self.device), backend)
        self.shape = ModelShape.from_hf(self.hf_config)
        self.max_model_len = resolve_max_model_len(config, self.shape.max_position_embeddings)
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                f"with chunked prefill disabled, max_num_batched_tokens "
                f"({config.max_num_batched_tokens}) must be >= max_model_len ({self.max_model_len})")
        self.num_blocks = self._num_kv_blocks()
        if tokenizer is None:
            from transformers import AutoTokenizer
            tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or config.model,
                                                      local_files_only=True)
        self.tokenizer = tokenizer
        self.kv = KVCacheManager(self.num_blocks, config.block_size, config.enable_prefix_caching)
        self.scheduler = Scheduler(
            self.kv, max_num_seqs=config.max_num_seqs,
            max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len, enable_chunked_prefill=config.enable_chunked_prefill)
        self.encoder = EncoderRunner(self.model.encode_images, EncoderCache(config.encoder_cache_size),
                                     self.device, self.dtype)
        self.runner = ModelRunner(
            self.model, self.encoder, num_blocks=self.num_blocks, block_size=config.block_size,
            num_layers=self.shape.num_layers, num_kv_heads=self.shape.num_kv_heads,
            head_dim=self.shape.head_dim, dtype=self.dtype, device=self.device,
            ops=get_ops(backend), seed=config.seed)
        self.outputs = OutputProcessor(self.tokenizer)
        self.attention_backend = backend
        self.prompt_tokens_total = 0
        self.generation_tokens_total = 0
        self._last_log = time.monotonic()
        logger.info("engine ready: %s on %s (%s, %s attention), %d KV blocks of %d tokens, "
                    "max_model_len %d", config.model, self.device, self.dtype, backend,
                    self.num_blocks, config.block_size, self.max_model_len)

    def _num_kv_blocks(self) -> int:
        c, s = self.config, self.shape
        if c.num_kv_blocks:
            return c.num_kv_blocks
        elem = torch.tensor([], dtype=self.dtype).element_size()
        per_block = 2 * s.num_layers * c.block_size * s.num_kv_heads * s.head_dim * elem
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(total * c.gpu_memory_utilization) - (total - free) - (1 << 30)
        else:
            budget = parse_size(c.kv_cache_memory)
        n = budget // per_block
        if n < 2:
            raise ValueError(f"KV cache budget {budget} bytes holds no blocks ({per_block} bytes "
                             "each): raise kv_cache_memory or gpu_memory_utilization")
        return int(n)

    # -- requests ---------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    mm_items: list[MMItem] | None = None, prompt: str | None = None,
                    hand_off_after_prefill: bool = False) -> None:
        """Queue a processed prompt. Raises ValueError on bad input; nothing else changes.

        ``hand_off_after_prefill``: stop after the first token and keep the prompt's KV
        blocks for ``export_kv`` (a prefill worker)."""
        mm_items = mm_items or []
        validate_request(prompt_token_ids, mm_items, self.shape, self.max_model_len,
                         self.shape.vocab_size)
        if request_id in self.outputs.parents:
            raise ValueError(f"request id {request_id!r} is already in use")
        positions, delta = self._mrope(len(prompt_token_ids), mm_items,
                                       self.shape.spatial_merge_size, self.shape.tokens_per_second)
        # Video frame spacing can push M-RoPE positions past the token count (and past
        # the rotary table): refuse rather than index out of range later.
        n = len(prompt_token_ids)
        last = min(self.max_model_len, n + (params.max_tokens or self.max_model_len)) - 1
        max_pos = max(int(positions.max()), last + delta)
        if max_pos >= self.shape.max_position_embeddings:
            raise ValueError(f"the prompt's M-RoPE positions reach {max_pos}, beyond the model's "
                             f"{self.shape.max_position_embeddings} positions; use a shorter "
                             "video (fewer frames) or a lower max_model_len")
        children = []
        for i in range(params.n):
            sp = params
            if params.n > 1:
                seed = None if params.seed is None else params.seed + i
                sp = SamplingParams(**{**{f: getattr(params, f) for f in params.__struct_fields__},
                                       "n": 1, "seed": seed})
            req = Request(request_id if params.n == 1 else f"{request_id}#{i}",
                          list(prompt_token_ids), sp, mm_items,
                          eos_token_id=self.tokenizer.eos_token_id,
                          mrope_positions=positions, mrope_delta=delta,
                          hand_off_after_prefill=hand_off_after_prefill)
            children.append(req)
        self.outputs.add(request_id, prompt, children, [
            IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.stop,
                                   params.skip_special_tokens, params.include_stop_str_in_output)
            for _ in children])
        for req in children:
            self.scheduler.add_request(req)
        self.prompt_tokens_total += len(prompt_token_ids)

    def export_kv(self, request_id: str) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """KV of a handed-off request, per layer ``[num_blocks, block_size, Hkv, D]`` each,
        then release its blocks (the copy is the transfer's end)."""
        ids = [b.block_id for b in self.kv.handed_off.get(request_id, [])]
        if not ids:
            raise KeyError(f"no handed-off KV for request {request_id!r}")
        idx = torch.tensor(ids, device=self.device)
        out = [(k.index_select(0, idx), v.index_select(0, idx)) for k, v in self.runner.kv_caches]
        self.kv.release_blocks(request_id)
        return out

    def import_request(self, request_id: str, prompt_token_ids: list[int], first_token: int,
                       params: SamplingParams, kv: list[tuple[torch.Tensor, torch.Tensor]],
                       mm_items: list[MMItem] | None = None) -> None:
        """Admit a request whose prompt KV was computed elsewhere (a decode worker).

        ``kv`` is what ``export_kv`` returned; ``first_token`` the prefill worker's sample."""
        if params.n != 1:
            raise ValueError("imported requests carry one completion (n=1)")
        mm_items = [MMItem(it.modality, it.mm_hash, it.offset, it.length, it.grid_thw, None,
                           it.second_per_grid_t) for it in (mm_items or [])]
        validate_request(prompt_token_ids, mm_items, self.shape, self.max_model_len,
                         self.shape.vocab_size)
        n_blocks = -(-len(prompt_token_ids) // self.config.block_size)
        if len(kv) != self.shape.num_layers or any(
                k.shape != (n_blocks, *self.runner.kv_caches[0][0].shape[1:]) for k, _ in kv):
            raise ValueError("imported KV does not match this model's cache layout")
        if not self.kv.pool.can_allocate(n_blocks):
            raise RuntimeError("no free KV blocks for the imported request; retry later")
        positions, delta = self._mrope(len(prompt_token_ids), mm_items,
                                       self.shape.spatial_merge_size, self.shape.tokens_per_second)
        req = Request(request_id, list(prompt_token_ids), params, mm_items,
                      eos_token_id=self.tokenizer.eos_token_id, mrope_positions=positions,
                      mrope_delta=delta, num_computed_tokens=len(prompt_token_ids))
        req.output_token_ids.append(first_token)
        blocks = self.kv.pool.allocate(n_blocks)
        idx = torch.tensor([b.block_id for b in blocks], device=self.device)
        for (kc, vc), (k, v) in zip(self.runner.kv_caches, kv):
            kc.index_copy_(0, idx, k.to(kc.device, kc.dtype))
            vc.index_copy_(0, idx, v.to(vc.device, vc.dtype))
        detok = IncrementalDetokenizer(self.tokenizer, prompt_token_ids, params.stop,
                                       params.skip_special_tokens, params.include_stop_str_in_output)
        detok.add_token(first_token)
        self.outputs.add(request_id, None, [req], [detok])
        self.scheduler.add_prefilled_request(req, [b.block_id for b in blocks])

    def abort_request(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            for req in self.outputs.children(rid):
                self.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
                self.runner.sampler.forget(req.request_id)
            self.outputs.drop(rid)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.num_unfinished > 0

    # -- the loop -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        sched = self.scheduler.schedule()
        if sched.empty:
            return []
        block_ids = {r.request_id: self.kv.block_ids(r.request_id) for r, _ in sched.scheduled}
        sampled, logprobs = self.runner.execute(sched, block_ids)
        produced = self.scheduler.update_from_output(sched, sampled)
        self.generation_tokens_total += len(produced)
        finished_by_stop = self.outputs.on_tokens(produced, logprobs)
        for req in finished_by_stop:  # stop strings are found in text, after the scheduler
            self.scheduler.finish(req, RequestStatus.FINISHED_STOPPED)
        for req in produced:
            if req.finished:
                self.runner.sampler.forget(req.request_id)
        self._maybe_log_stats()
        return self.outputs.collect(produced)

    def _maybe_log_stats(self) -> None:
        now = time.monotonic()
        if self.config.disable_log_stats or now - self._last_log < 10.0:
            return
        self._last_log = now
        s = self.stats()
        logger.info("running %d, waiting %d, KV cache %.1f%%, preemptions %d, prefix hit rate "
                    "%.1f%%, encoder cache hit rate %.1f%%", s["num_requests_running"],
                    s["num_requests_waiting"], 100 * s["kv_cache_usage_perc"],
                    s["num_preemptions_total"],
                    100 * s["prefix_cache_hits"] / max(s["prefix_cache_queries"], 1),
                    100 * s["encoder_cache_hits"] / max(s["encoder_cache_queries"], 1))

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
        }
