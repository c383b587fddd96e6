"""The in-process engine lets go of its device memory: ``LLM.close()`` (and ``with LLM(...)``)
drops the model, the KV cache and the encoder cache, so a second engine in the process
starts with the whole share; and the profile run that sizes a CUDA cache runs here, on the
CPU, through the real runner and leaves nothing behind (engine/sizing/profile_run.py)."""
from __future__ import annotations

import gc
import weakref

import pytest
from triptych import LLM, SamplingParams
from triptych.engine.sizing.profile_run import (
    largest_image,
    max_image_tokens,
    profile_blocks,
    profile_step,
    run_profile,
)

KNOBS = {"block_size": 4, "max_num_batched_tokens": 64, "max_num_seqs": 8,
         "max_model_len": 512, "num_kv_blocks": 256}
GREEDY = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


def _image_prompt(llm: LLM) -> dict:
    from PIL import Image

    img = Image.new("RGB", (84, 56), (200, 30, 90))
    return {"prompt": "<|vision_start|><|image_pad|><|vision_end|>What is it?",
            "multi_modal_data": {"image": img}}


def _held(llm: LLM) -> list[weakref.ref]:
    """Weak references to what the engine holds: KV cache tensors, parameters, buffers,
    the encoder cache and its embeddings."""
    core = llm.engine.core
    refs = [weakref.ref(t) for pair in core.runner.kv_caches for t in pair]
    refs += [weakref.ref(p) for p in core.model.parameters()]
    refs += [weakref.ref(b) for b in core.model.buffers()]
    refs += [weakref.ref(core.encoder.cache), weakref.ref(core.runner), weakref.ref(core)]
    cached = core.encoder.cache.keys()
    refs += [weakref.ref(core.encoder.cache.get(k)) for k in cached]
    return refs


def test_close_drops_model_kv_and_encoder_cache(tiny_qwen2_vl):
    llm = LLM(tiny_qwen2_vl, **KNOBS)
    first = llm.generate([_image_prompt(llm)], GREEDY, use_tqdm=False)[0]
    assert len(llm.engine.encoder.cache) == 1  # the image's embedding is cached
    refs = _held(llm)
    assert len(refs) > 10 and all(r() is not None for r in refs)
    llm.close()
    gc.collect()
    assert [r for r in refs if r() is not None] == []
    llm.close()  # twice is fine
    # another engine in the same process, as the first started
    with LLM(tiny_qwen2_vl, **KNOBS) as again:
        second = again.generate([_image_prompt(again)], GREEDY, use_tqdm=False)[0]
        refs = _held(again)
    assert again.engine is None and [r for r in refs if r() is not None] == []
    assert second.outputs[0].token_ids == first.outputs[0].token_ids


def test_context_manager_closes_on_error(tiny_qwen2_vl):
    with pytest.raises(RuntimeError, match="boom"), LLM(tiny_qwen2_vl, **KNOBS) as llm:
        refs = _held(llm)
        raise RuntimeError("boom")
    gc.collect()
    assert llm.engine is None and [r for r in refs if r() is not None] == []


def test_profile_step_runs_at_the_limits_and_leaves_nothing(tiny_qwen2_vl):
    with LLM(tiny_qwen2_vl, **KNOBS) as fresh:
        prompts = [_image_prompt(fresh), "Tell me a story."]
        reference = [o.outputs[0].token_ids
                     for o in fresh.generate(prompts, GREEDY, use_tqdm=False)]
    with LLM(tiny_qwen2_vl, **KNOBS) as llm:  # a CUDA start, before any request:
        core, cfg = llm.engine.core, llm.config
        image = largest_image(cfg.model, core.hf_config, max_image_tokens(cfg, 512))
        # the tiny processor's cap: 200704 pixels, 14-pixel patches merged 2 x 2
        assert image is not None and 200 <= image.length <= 256
        step = profile_step(cfg, core.shape, core.hf_config, core.max_model_len, image)
        (first, n0), (plp, n1), *rest = step.scheduled
        assert first.mm_items == [image] and n0 == 64 - 7  # the rest: one token each
        assert len(step.scheduled) == 8 and step.num_scheduled_tokens == 64
        # one asks for prompt logprobs over its whole chunk; each of the others samples
        assert plp.sampling_params.prompt_logprobs and len(plp.prompt_token_ids) == n1 + 1
        assert all(len(r.prompt_token_ids) == n for r, n in rest)
        assert max(b for ids in step.block_ids.values() for b in ids) < profile_blocks(cfg)
        run_profile(core.runner, step)  # the real runner: the tower, the LM, the sampler
        assert len(core.encoder.cache) == 0 and core.encoder.num_items_encoded == 0
        core.runner.allocate_kv_cache(core.num_blocks)  # the real cache replaces the small
        after = llm.generate(prompts, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in after] == reference


def test_text_only_profile_fills_the_budget(tiny_qwen2_vl):
    from transformers import AutoConfig
    from triptych.config import EngineConfig
    from triptych.engine.scheduler import PROMPT_LOGPROBS_CHUNK
    from triptych.engine.sizing.model_shape import ModelShape

    hf = AutoConfig.from_pretrained(tiny_qwen2_vl, local_files_only=True)
    cfg = EngineConfig(model=tiny_qwen2_vl, max_num_batched_tokens=100, max_num_seqs=7)
    step = profile_step(cfg, ModelShape.from_hf(hf), hf, 512, None)
    # the prompt-logprobs chunk takes what the 6 sampled one-token prompts leave
    assert [n for _, n in step.scheduled] == [94, 1, 1, 1, 1, 1, 1]
    assert [r.sampling_params.prompt_logprobs for r, _ in step.scheduled] == [5] + [None] * 6
    assert all(not r.mm_items for r, _ in step.scheduled)
    big = EngineConfig(model=tiny_qwen2_vl, max_num_batched_tokens=8192, max_num_seqs=256)
    step = profile_step(big, ModelShape.from_hf(hf), hf, 4096, None)
    assert step.scheduled[0][1] == PROMPT_LOGPROBS_CHUNK and len(step.scheduled) == 256
    assert step.num_scheduled_tokens == 8192


def test_del_frees_the_in_process_engine(tiny_qwen2_vl):
    """``del llm; gc.collect()``, as vLLM's users free an engine: the same as close()."""
    llm = LLM(tiny_qwen2_vl, **KNOBS)
    llm.generate([_image_prompt(llm)], GREEDY, use_tqdm=False)
    refs = _held(llm)
    assert all(r() is not None for r in refs)
    del llm
    gc.collect()
    assert [r for r in refs if r() is not None] == []


def test_del_frees_an_engine_with_pools(tiny_qwen2_vl):
    """1e1p1d: ``del llm; gc.collect()`` ends its three worker processes, the router's
    thread, its run directory and shared memory, as close() does (the router thread was
    once held by an atexit hook, and 3 of 3 workers outlived the del)."""
    import glob
    import os
    import sys
    import tempfile
    import threading

    sys.path.insert(0, os.path.dirname(__file__))
    from server_fixtures import _children, alive

    def ours() -> set[str]:
        return set(glob.glob(f"/dev/shm/triptych*{os.getpid()}*")) | set(glob.glob(
            os.path.join(tempfile.gettempdir(), f"triptych-{os.getpid()}-*")))

    before = ours()
    llm = LLM(tiny_qwen2_vl, encode_workers=1, prefill_workers=1, decode_workers=1,
              max_model_len=512, kv_cache_memory="32MiB")
    out = llm.generate([_image_prompt(llm)], GREEDY, use_tqdm=False)[0]
    assert len(out.outputs[0].token_ids) == 5
    workers = [p for p in _children(os.getpid()) if alive(p)]
    assert len(workers) >= 3 and any(t.name == "triptych-router"
                                     for t in threading.enumerate())
    del llm, out
    gc.collect()
    assert [p for p in workers if alive(p)] == []  # gone when gc.collect() returns
    assert not any(t.name == "triptych-router" for t in threading.enumerate())
    assert ours() - before == set()
