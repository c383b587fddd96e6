"""Async scheduling (engine/engine_core.py, vLLM's --async-scheduling), held on the CPU.

Step N+1 is scheduled, its inputs staged and its forward run before step N's sampled ids
are read: a decode's input is then a token still "on the device", taken from step N's ids
tensor by the runner (engine/runner/model_runner.py), and the scheduler counts it as an output
placeholder (engine/scheduler.py). On the CPU the device is the host, so nothing overlaps,
but every piece of the bookkeeping runs: the greedy ids (and seeded draws, logprobs,
penalties, grammars, stops, images, chunks, prefix hits, preemption) must equal the
synchronous engine's, which tests/test_engine_parity.py holds to HF's.
"""
from __future__ import annotations

import numpy as np
import pytest
from PIL import Image
from triptych import LLM, SamplingParams
from triptych.engine.kv.kv_cache_manager import KVCacheManager
from triptych.engine.request import Request, RequestStatus
from triptych.engine.scheduler import Scheduler
from triptych.engine.structured.structured_params import StructuredOutputsParams

WORDS = ["the", "cat", "sat", "on", "a", "mat", "and", "looked", "at", "the", "dog", "who",
         "barked", "twice"]


def _img(seed: int, w: int, h: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), np.uint8))


def _prompts(n: int) -> list[dict]:
    return [{"prompt": " ".join(WORDS[(i + j) % len(WORDS)] for j in range(3 + 7 * i))}
            for i in range(n)]


def _engine(model: str, mode: bool, **kw) -> LLM:
    return LLM(model, block_size=4, max_num_seqs=3, max_num_batched_tokens=24,
               async_scheduling=mode, cpu_threads=1, **{"kv_cache_memory": "8MiB", **kw})


def _work(llm: LLM, stop_ids: list[int]) -> list:
    """A mix that exercises each path: plain greedy (some stop early on a token of theirs),
    penalties and grammar (their sampling waits for the token in flight), seeded sampling
    with logprobs, prompt logprobs, a chunked image prompt twice (a prefix hit)."""
    p = [SamplingParams(temperature=0, max_tokens=4 + 2 * i, ignore_eos=True) for i in range(6)]
    p[0] = SamplingParams(temperature=0, max_tokens=12, stop_token_ids=stop_ids[:1])
    p[1] = SamplingParams(temperature=0, max_tokens=8, repetition_penalty=1.3,
                          presence_penalty=0.5, ignore_eos=True)
    p[2] = SamplingParams(temperature=0, max_tokens=10, stop_token_ids=stop_ids[1:2])
    p[3] = SamplingParams(temperature=0.8, top_k=5, seed=7, max_tokens=6, logprobs=2)
    p[4] = SamplingParams(temperature=0, max_tokens=5, prompt_logprobs=2, ignore_eos=True)
    p[5] = SamplingParams(temperature=0, max_tokens=24, seed=1, structured_outputs=
                          StructuredOutputsParams(json_object=True))
    outs = llm.generate(_prompts(6), p, use_tqdm=False)
    got = [(o.outputs[0].token_ids, o.outputs[0].finish_reason,
            [sorted(d) for d in (o.outputs[0].logprobs or [])]) for o in outs]
    got.append([sorted(d or {}) for d in outs[4].prompt_logprobs[1:]])
    conv = [{"role": "user", "content": [{"type": "image", "image": _img(1, 112, 84)},
                                          {"type": "text", "text": "What is this?"}]}]
    sp = SamplingParams(temperature=0, max_tokens=5, ignore_eos=True)
    for _ in range(2):
        got.append(llm.chat([conv], sp, use_tqdm=False)[0].outputs[0].token_ids)
    return got


def test_async_steps_give_the_synchronous_ids(tiny_qwen2_vl):
    sync = _engine(tiny_qwen2_vl, False)
    # stop tokens the sync run emits mid-way: the async run has scheduled past them
    probe = sync.generate(_prompts(3), SamplingParams(temperature=0, max_tokens=12,
                                                      ignore_eos=True), use_tqdm=False)
    stop_ids = [probe[0].outputs[0].token_ids[3], probe[2].outputs[0].token_ids[5]]
    want = _work(sync, stop_ids)
    assert not sync.engine.core.async_scheduling
    assert sync.engine.core.runner.num_inputs_from_device == 0
    sync.close()
    llm = _engine(tiny_qwen2_vl, True)
    got = _work(llm, stop_ids)
    runner = llm.engine.core.runner
    assert llm.engine.core.async_scheduling and runner.num_inputs_from_device > 0
    assert got == want
    assert want[0][1] == "stop" and len(want[0][0]) < 12  # a stop did cut it short
    assert llm.get_tokenizer().decode(want[5][0]).startswith("{")  # (the mask held)
    # penalties and the grammar sampled after the token in flight was read
    assert llm.engine.core.num_ordered_steps > 0
    llm.close()


def test_preemption_with_a_token_in_flight(tiny_qwen2_vl):
    """A cache too small for the batch: requests are preempted while their last token is
    still on the device, and recompute it later: the same ids as without async."""
    kw = {"kv_cache_memory": None, "num_kv_blocks": 24, "max_num_seqs": 4}
    prompts = _prompts(4)
    sp = [SamplingParams(temperature=0, max_tokens=14, ignore_eos=True) for _ in prompts]
    outs = {}
    for mode in (False, True):
        llm = LLM(tiny_qwen2_vl, block_size=4, async_scheduling=mode, cpu_threads=1, **kw)
        outs[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        assert llm.engine.core.scheduler.num_preemptions_total > 0
        llm.close()
    assert outs[True] == outs[False]


def test_placeholders_bound_what_is_scheduled():
    """The scheduler half of it: step N+1 is scheduled before step N's token is known; a
    request is not scheduled past max_tokens counting its placeholders; a stop at step N's
    token drops step N+1's; blocks are published only up to known tokens."""
    kv = KVCacheManager(32, 4, True)
    s = Scheduler(kv, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64)
    a = Request("a", list(range(6)), SamplingParams(max_tokens=3, ignore_eos=True))
    b = Request("b", list(range(10, 16)), SamplingParams(max_tokens=9, stop_token_ids=[7]))
    s.add_request(a)
    s.add_request(b)
    n1 = s.schedule()
    assert [(r.request_id, n) for r, n in n1.scheduled] == [("a", 6), ("b", 6)]
    assert n1.sampling == {"a", "b"} and a.num_output_placeholders == 1
    n2 = s.schedule()  # n1's tokens unknown: each decodes at its placeholder
    assert [(r.request_id, n) for r, n in n2.scheduled] == [("a", 1), ("b", 1)]
    assert a.num_computed_tokens == 7 and a.num_tokens == 6 and a.num_output_placeholders == 2
    s.update_from_output(n1, {"a": 5, "b": 7})  # b stops at its first token
    assert b.status == RequestStatus.FINISHED_STOPPED and b.output_token_ids == [7]
    n3 = s.schedule()
    assert [(r.request_id, n) for r, n in n3.scheduled] == [("a", 1)]  # a's 3rd and last
    assert s.schedule().empty  # a: 1 known + 2 in flight = max_tokens
    s.update_from_output(n2, {"a": 6, "b": 8})  # b's second token is dropped
    assert b.output_token_ids == [7] and a.output_token_ids == [5, 6]
    s.update_from_output(n3, {"a": 9})
    assert a.status == RequestStatus.FINISHED_LENGTH and a.output_token_ids == [5, 6, 9]
    assert a.num_output_placeholders == 0 and not s.num_unfinished
    kv.check_integrity()


@pytest.mark.parametrize("mode", [False, True], ids=["sync", "async"])
def test_engine_steps_end_with_nothing_in_flight_for_a_live_request(tiny_qwen2_vl, mode):
    """The offline loop stops when every request has finished: nothing a client waits for
    is left on the device (the last outputs come from the step that reads them)."""
    llm = _engine(tiny_qwen2_vl, mode)
    outs = llm.generate(_prompts(4), SamplingParams(temperature=0, max_tokens=5,
                                                    ignore_eos=True), use_tqdm=False)
    assert all(len(o.outputs[0].token_ids) == 5 and o.finished for o in outs)
    core = llm.engine.core
    assert not core.scheduler.requests and not core.kv.req_blocks
    llm.close()


def test_the_cuda_path_with_graph_replays_gives_the_synchronous_ids(tiny_qwen2_vl):
    """The CUDA engine's path (engine/device/rehearsal.py: Triton under the interpreter, logits and
    the device sampler, packed staging) with decode steps replayed through the graph
    runner: the token in flight is written into the step's staged inputs on the device and
    copied into the graph's persistent buffers from there. Same ids as synchronous eager."""
    from triptych.engine.device.rehearsal import REHEARSAL_KNOBS, rehearse_cuda

    prompts = _prompts(4)
    sp = [SamplingParams(temperature=0, max_tokens=3 + 2 * i, ignore_eos=True) for i in range(4)]
    got = {}
    for mode, graphs in ((False, None), (True, [1, 2, 4])):
        llm = _engine(tiny_qwen2_vl, mode, **REHEARSAL_KNOBS)
        rehearse_cuda(llm.engine.core, graphs)
        got[mode] = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
        runner = llm.engine.core.runner
        if graphs:
            assert runner.graphs.num_replays > 0 and runner.num_inputs_from_device > 0
        llm.close()
    assert got[True] == got[False]
