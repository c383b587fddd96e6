"""LLMEngine: the colocated engine in-process (encode + prefill + decode, no processes).

An ``EngineCore`` (token ids) plus an ``OutputProcessor`` (text) in one loop; the offline
``LLM`` drives it. The server and the disaggregated pools run the same two halves in
different processes: the core in each worker, the output processor in the API process.

NOTE: it lives beside ``llm.py``, not in ``engine/``: it assembles a process (thread
policy from ``worker/threads.py``, the model from ``parallel/loader.py``, which may start
tensor-parallel ranks) the way a pool worker does, and ``engine/`` stands below both.

    step():  core.step() -> output_processor.process() -> abort what stop strings ended
"""
from __future__ import annotations

import logging
import time
from typing import Any

import torch
from triptych.config import EngineConfig
from triptych.engine.device.platform import applies_host_policies
from triptych.engine.engine_core import EngineCore
from triptych.engine.outputs import RequestOutput
from triptych.engine.request import MMItem
from triptych.engine.sample.sampling_params import SamplingParams
from triptych.parallel.loader import load_engine_core
from triptych.router.output_processor import OutputProcessor
from triptych.worker.allocator import StepTrim
from triptych.worker.threads import apply_thread_policy

logger = logging.getLogger("triptych.engine")


class LLMEngine:
    """The colocated engine of one process: token ids in the core, text around it."""

    def __init__(self, config: EngineConfig, tokenizer: Any | None = None) -> None:
        if config.data_parallel_size != 1:
            raise ValueError("data_parallel_size > 1 runs replicas as worker processes: use "
                             "`triptych serve` or LLM(...), not LLMEngine directly")
        # Threads and OpenMP wait policy of this process, before the model runs (an engine
        # on the CPU: a GPU engine keeps torch's defaults, engine/device/platform.py)
        self.cpu_threads = apply_thread_policy(config.cpu_threads) \
            if applies_host_policies(config.device) else torch.get_num_threads()
        self.trim = StepTrim()  # the allocator keeps what the steps need (worker/allocator.py)
        if tokenizer is None:
            from transformers import AutoTokenizer
            tokenizer = AutoTokenizer.from_pretrained(config.tokenizer or config.model,
                                                      local_files_only=True)
        self.config = config
        self.tokenizer = tokenizer
        self.core: EngineCore = load_engine_core(config, tokenizer.eos_token_id)
        self.outputs = OutputProcessor(tokenizer)
        self._last_log = time.monotonic()

    # The parts tests and tools look at, owned by the core.
    kv = property(lambda self: self.core.kv)
    scheduler = property(lambda self: self.core.scheduler)
    runner = property(lambda self: self.core.runner)
    model = property(lambda self: self.core.model)
    encoder = property(lambda self: self.core.encoder)
    shape = property(lambda self: self.core.shape)
    max_model_len = property(lambda self: self.core.max_model_len)
    device = property(lambda self: self.core.device)
    dtype = property(lambda self: self.core.dtype)
    attention_backend = property(lambda self: self.core.attention_backend)

    # -- requests ---------------------------------------------------------------------------
    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams,
                    mm_items: list[MMItem] | None = None, prompt: str | None = None,
                    hand_off_after_prefill: bool = False, stream: bool = False) -> None:
        """Queue a processed prompt. Raises ValueError on bad input; nothing else changes.

        ``hand_off_after_prefill``: stop after the first token and keep the prompt's KV
        blocks for a ``KVSender`` (what a prefill worker does). ``stream``: text deltas are read as the
        request runs (otherwise its text is decoded once, at the end)."""
        mm_items = mm_items or []
        params.verify()
        self.core.check_request(prompt_token_ids, params, mm_items)  # before any child joins
        kids = self.outputs.add(request_id, prompt, prompt_token_ids, params, stream)
        for cid, sp in kids:
            self.core.add_request(cid, prompt_token_ids, sp, mm_items,
                                  hand_off_after_prefill=hand_off_after_prefill)

    def abort_request(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.core.abort(self.outputs.child_ids(rid))
            self.outputs.drop(rid)

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests()

    # -- the loop -----------------------------------------------------------------------------
    def step(self) -> list[RequestOutput]:
        outs, stopped = self.outputs.process(self.core.step().outputs)
        self.trim.after_step()
        self.core.abort(stopped)  # stop strings are found in text, after the core
        self._maybe_log_stats()
        return outs

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

    def close(self) -> None:
        """Stop the core (and its tensor-parallel ranks) and let go of it: the model, the KV
        cache and the encoder cache are freed once nothing else holds this engine."""
        self.core.close()
        del self.core

    def stats(self) -> dict[str, float]:
        """Gauges and counters, named as the Prometheus metrics (without the prefix)."""
        return self.core.stats()
