"""Start-up warm-up: the step shapes the first requests meet, run once before the engine
takes any, so their kernel variants are compiled then, not on a user's step.

A cold Triton variant compiles on the step that first meets it (0.5-1.5 s each on a GPU;
three or four of them stall the first user's request by seconds). Which variant runs
depends on the step's shape: the decode kernel with one split or several (context
shorter or longer than one key tile), the paged prefill's 16-, 32- or 64-row query tile
(a chunk after a cached prefix: a prefix hit, a chunked prompt's later chunks), the
norm with and without its residual, a mixed step's two halves, greedy and random sampling.
The steps below cover each, over a private scheduler and block list on the real cache
(nothing is cached or kept: the engine's own KV manager never sees these blocks):

    step 1  prefill    a: 40 of 120 tokens, b: 12 (whole), c: 30   no cached prefix
    step 2  mixed      b decodes; a: 10 more (prefix)               16-row tile
    step 3  mixed      b decodes; a: 25 more                        32-row tile
    step 4  mixed      b decodes; a: 45 more (samples)              64-row tile
    step 5  decode     a (121 tokens: split-K), b                   random + greedy rows
    step 6  decode     b alone (short: one split)

Decode CUDA graphs warm up their own launches when captured (engine/device/cuda_graphs.py).
"""
from __future__ import annotations

import logging
import time
from typing import Any

from triptych.engine.kv.kv_cache_manager import KVCacheManager
from triptych.engine.request import Request
from triptych.engine.sample.sampling_params import SamplingParams
from triptych.engine.scheduler import SchedulerOutput

logger = logging.getLogger("triptych.warmup")

WARMUP_ID = "~warmup-"  # never a request id of the router or LLM
# (request, tokens) per step; see the module docstring
STEPS = [[("a", 40), ("b", 12), ("c", 30)], [("b", 1), ("a", 10)], [("b", 1), ("a", 25)],
         [("b", 1), ("a", 45)], [("a", 1), ("b", 1)], [("b", 1)]]
PROMPTS = {"a": 120, "b": 12, "c": 80}


def warm_up(runner: Any, num_blocks: int, block_size: int, max_model_len: int,
            text_token: int) -> float:
    """Run the warm-up steps on ``runner`` (between its start and the first request);
    returns the seconds taken. Steps that do not fit the cache or max_model_len are
    skipped (a tiny test engine)."""
    t0 = time.perf_counter()
    kv = KVCacheManager(num_blocks, block_size, False)
    reqs = {name: Request(f"{WARMUP_ID}{name}", [text_token] * n, _params(name))
            for name, n in PROMPTS.items()}
    for step in STEPS:
        out = SchedulerOutput([], 0)
        for name, n in step:
            req = reqs[name]
            if req.num_computed_tokens + n >= max_model_len or \
                    kv.allocate_slots(req, n) is None:
                continue
            req.num_computed_tokens += n
            out.scheduled.append((req, n))
            out.block_ids[req.request_id] = kv.block_ids(req.request_id)
        if out.empty:
            continue
        out.num_scheduled_tokens = sum(n for _, n in out.scheduled)
        got = runner.execute(out)
        for req, _ in out.scheduled:  # (as the scheduler appends them)
            tok = got.sampled.get(req.request_id)
            if tok is not None:
                req.output_token_ids.append(tok)
    for req in reqs.values():
        kv.free(req)
        runner.sampler.forget(req.request_id)
    seconds = time.perf_counter() - t0
    logger.info("warm-up: the step shapes of the first requests compiled in %.1f s", seconds)
    return seconds


def _params(name: str) -> SamplingParams:
    if name == "a":  # the random path (temperature, top-k, top-p, a seed, logprobs)
        return SamplingParams(temperature=0.7, top_k=20, top_p=0.9, seed=0, logprobs=2)
    return SamplingParams(temperature=0)
