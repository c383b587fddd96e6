"""Qwen3-VL video against HF transformers: its processor's layout and its model's tokens.

NOTE: not HF end to end, unlike the image oracles (models/hf_oracle.hf_chat_greedy):
HF's Qwen3VLVideoProcessor resizes with torchvision (a NameError on `tvF` without it), and
PyPI's torchvision wheels are built for CUDA torch, so they fail to import beside the CPU
wheel these machines run. So the project patchifies videos itself (api/media/video.py)
and builds the prompt as Qwen3VLProcessor does: per temporal group,
"<t seconds><|vision_start|>" + the group's video tokens + "<|vision_end|>". Here HF's own
code is the reference for each piece it can run without torchvision (the clip's
smart_resize, the patchify, the placeholder string with its timestamps), and HF's
Qwen3VLForConditionalGeneration, given the clip as HF's processor gives it (one
pixel_values_videos block, one video_grid_thw row per video), is the oracle of the greedy
tokens: colocated with chunks cutting the spans, and 1e1p1d (the groups' DeepStack payloads
travel encode -> prefill). Temporal groups go to the engine as video items of grid
(1, h, w): their keys, and a processor-cache hit re-making one group's pixels, are tested.
"""
from __future__ import annotations

import os
import sys
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from triptych import LLM, SamplingParams
from triptych.models.hf_oracle import hf_greedy, load_hf_model

sys.path.insert(0, os.path.dirname(__file__))
from server_fixtures import img as image  # noqa: E402

MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
KNOBS = {"block_size": 4, "kv_cache_memory": "64MiB", "max_model_len": 512,
         "max_num_batched_tokens": 16}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    from triptych.models.tiny import make_tiny

    return make_tiny("qwen3_vl", str(tmp_path_factory.mktemp("tiny") / "qwen3_vl"), seed=0)


@pytest.fixture(scope="module")
def oracle(tiny):
    return load_hf_model(tiny)


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(tiny, **KNOBS)


def frames(seed: int, n: int, h: int, w: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 255, (n, h, w, 3), dtype=np.uint8)


def video_chat(text: str, clip: np.ndarray, *images) -> list[dict]:
    parts = [{"type": "video", "video": clip}]
    parts += [{"type": "image", "image": im} for im in images]
    return [{"role": "user", "content": parts + [{"type": "text", "text": text}]}]


VIDEO = video_chat("What happens?", frames(0, 6, 64, 96))  # 3 groups of 2x3 tokens
MIXED = video_chat("Compare the clip with the picture.", frames(1, 4, 96, 64), image(2, 56, 84))


def hf_placeholder(proc, grid_t: int, frame_tokens: int, n: int | None = None) -> str:
    """Qwen3VLProcessor.replace_video_token's string for ``n`` frames sampled at
    ``video_fps``."""
    from transformers.models.qwen3_vl.processing_qwen3_vl import Qwen3VLProcessor
    from transformers.video_utils import VideoMetadata

    n = n or grid_t * 2
    meta = VideoMetadata(total_num_frames=n, fps=proc.media.video_fps,
                         frames_indices=list(range(n)))
    me = SimpleNamespace(video_processor=SimpleNamespace(merge_size=2, temporal_patch_size=2),
                         video_token="<|video_pad|>", vision_start_token="<|vision_start|>",
                         vision_end_token="<|vision_end|>")
    me._calculate_timestamps = lambda *a: Qwen3VLProcessor._calculate_timestamps(me, *a)
    grid = torch.tensor([[grid_t, 2 * 2, frame_tokens]])  # t, h, w: h*w/4 = frame_tokens
    return Qwen3VLProcessor.replace_video_token(
        me, {"video_grid_thw": grid, "video_metadata": [meta]}, 0)


def test_prompt_and_pixels_are_hf_processors(llm):
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import (
        Qwen3VLVideoProcessor,
        smart_resize,
    )

    proc = llm.processor
    p = proc.process_chat(VIDEO)
    assert [it.grid_thw for it in p.mm_items] == [(1, 4, 6)] * 3
    assert all(it.modality == "video" for it in p.mm_items)
    assert len({it.mm_hash for it in p.mm_items}) == 3
    # the prompt: the template's <|video_pad|> replaced by HF's string (timestamps included)
    tok = llm.get_tokenizer()
    want = tok.apply_chat_template(VIDEO, tokenize=False, add_generation_prompt=True)
    want = want.replace("<|video_pad|>", hf_placeholder(proc, 3, 6))
    assert "<0.2 seconds>" in want and "<2.2 seconds>" in want
    assert p.prompt_token_ids == tok.encode(want, add_special_tokens=False)
    # an odd clip: HF pads the frame indices with the last one (its time, not a later one)
    odd = video_chat("What happens?", frames(0, 5, 64, 96))
    want = tok.apply_chat_template(odd, tokenize=False, add_generation_prompt=True)
    want = want.replace("<|video_pad|>", hf_placeholder(proc, 3, 6, n=5))
    assert "<2.0 seconds>" in want
    assert proc.process_chat(odd).prompt_token_ids == tok.encode(want, add_special_tokens=False)
    # the pixels: HF's patchify of the rescaled, normalised clip (64x96 needs no resize)
    clip = torch.from_numpy(frames(0, 6, 64, 96)).permute(0, 3, 1, 2).float() / 255
    clip = ((clip - 0.5) / 0.5)[None]
    ref, t, h, w = Qwen3VLVideoProcessor.patchify(None, clip, 16, 2, 2)
    got = torch.cat([it.pixel_values for it in p.mm_items])
    assert (t, h, w) == (3, 4, 6) and torch.allclose(got, ref[0], atol=1e-5)
    # the clip's pixel budget is HF's (frames x h x w), not Qwen2-VL's per frame
    big = proc.process_chat(video_chat("x", frames(3, 4, 480, 640))).mm_items
    rh, rw = smart_resize(4, 480, 640, temporal_factor=2, factor=32,
                          min_pixels=proc.video_min_pixels, max_pixels=proc.video_max_pixels)
    assert [it.grid_thw for it in big] == [(1, rh // 16, rw // 16)] * 2


def test_the_per_frame_cap_is_hfs(tiny, llm, tmp_path):
    """A checkpoint whose video_preprocessor_config.json sets cap_pixels_per_frame (and
    max_video_tokens): each clip's grid is the one HF's Qwen3VLVideoProcessor computes for
    it (its own get_num_of_video_patches, which runs without torchvision), and differs from
    the uncapped one where the cap binds. The cap is part of the cache key."""
    import json
    import shutil

    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor
    from triptych.api.processor import InputProcessor

    capped = str(tmp_path / "capped")
    shutil.copytree(tiny, capped)
    path = os.path.join(capped, "video_preprocessor_config.json")
    with open(path) as f:
        cfg = json.load(f)
    with open(path, "w") as f:  # 6 cells of 32x32 per frame at most
        json.dump({**cfg, "cap_pixels_per_frame": True, "max_video_tokens": 6}, f)
    proc = InputProcessor(capped)
    hf = Qwen3VLVideoProcessor.from_pretrained(capped)
    assert hf.cap_pixels_per_frame is True
    binds = 0
    for seed, (n, h, w) in enumerate([(4, 480, 640), (2, 200, 300), (16, 120, 160), (5, 64, 96)]):
        conv = video_chat("x", frames(seed, n, h, w))
        items = proc.process_chat(conv).mm_items
        got = sum(t * gh * gw for t, gh, gw in (it.grid_thw for it in items))
        assert got == hf.get_num_of_video_patches(n, h, w), (n, h, w)
        uncapped = sum(t * gh * gw for t, gh, gw in
                       (it.grid_thw for it in llm.processor.process_chat(conv).mm_items))
        binds += got != uncapped
    assert binds >= 2
    assert proc.video_hash_kwargs != llm.processor.video_hash_kwargs


@pytest.mark.parametrize("conv", [VIDEO, MIXED], ids=["video", "video+image"])
def test_greedy_equals_hf(llm, oracle, conv):
    """Chunks of 16 cut the groups' spans; HF gets the clip as one grid (t, h, w)."""
    p = llm.processor.process_chat(conv)
    want, _ = hf_greedy(oracle, p, MAX_TOKENS, llm.get_tokenizer().pad_token_id or 0)
    (out,) = llm.chat(conv, GREEDY, use_tqdm=False)
    assert out.prompt_token_ids == p.prompt_token_ids
    assert out.outputs[0].token_ids == want


def test_the_video_changes_the_output(llm):
    a = llm.chat(VIDEO, GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    other = video_chat("What happens?", frames(9, 6, 64, 96))
    assert llm.chat(other, GREEDY, use_tqdm=False)[0].outputs[0].token_ids != a


def test_encode_prefill_decode_pools(tiny, oracle, llm):
    convs = [VIDEO, MIXED]
    pad = llm.get_tokenizer().pad_token_id or 0
    want = [hf_greedy(oracle, llm.processor.process_chat(c), MAX_TOKENS, pad)[0] for c in convs]
    pools = LLM(tiny, **KNOBS, encode_workers=1, prefill_workers=1, decode_workers=1)
    try:
        outs = pools.chat(convs, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
    finally:
        pools.close()


def test_a_cache_hit_remakes_each_groups_pixels(tiny):
    from triptych.api.processor import InputProcessor
    from triptych.mmcache.index import ProcessorCacheIndex

    proc = InputProcessor(tiny, cache=ProcessorCacheIndex(1 << 26))
    first = proc.process_chat(VIDEO)
    again = proc.process_chat(VIDEO)
    assert all(it.pixel_values is None for it in again.mm_items)  # a hit: nothing decoded
    assert [it.mm_hash for it in again.mm_items] == [it.mm_hash for it in first.mm_items]
    assert [s.meta.shape for s in again.mm_sources] == \
        [tuple(it.pixel_values.shape) for it in first.mm_items]
    processed = proc.counts.processed
    proc.ensure_pixels(again)
    assert proc.counts.processed == processed + 1, "the clip is processed once for its groups"
    for a, b in zip(first.mm_items, again.mm_items):
        assert torch.equal(a.pixel_values, b.pixel_values)
