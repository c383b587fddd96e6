"""Qwen3-VL (dense) against HF transformers end to end on a tiny `make-tiny` checkpoint.

The oracle is HF's own Qwen3VLProcessor on the raw messages and images, then HF's
generate (models/hf_oracle.py). Prompts and greedy ids equal HF's for text only, one
image, two images of different sizes, images of the shapes users send (a 4:3 photo, an
icon below the minimum, a photo large enough to be resized, several in one prompt) and a
multi-turn conversation; colocated and 1e1p1d (the DeepStack payload travels the encoder
cache and the connector); chunked prefill through an image span (the payload's DeepStack
rows split with the embedding rows); prefix-cache hits across turns. The tiny checkpoint's
head_dim differs from hidden / heads and two of its three vision blocks feed DeepStack.
"""
from __future__ import annotations

import json
import os
import shutil
import sys

import pytest
import torch

from triptych import LLM, SamplingParams
from triptych.models.hf_oracle import hf_chat_greedy, load_hf_model, load_hf_processor

sys.path.insert(0, os.path.dirname(__file__))
from server_fixtures import image_chat as chat  # noqa: E402
from server_fixtures import img as image  # noqa: E402

MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
KNOBS = {"block_size": 4, "kv_cache_memory": "64MiB", "max_model_len": 512}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    from triptych.models.tiny import make_tiny

    return make_tiny("qwen3_vl", str(tmp_path_factory.mktemp("tiny") / "qwen3_vl"), seed=0)


@pytest.fixture(scope="module")
def oracle(tiny):
    return load_hf_model(tiny)


@pytest.fixture(scope="module")
def processor(tiny):
    """HF's Qwen3VLProcessor for the checkpoint: with ``oracle``, HF end to end."""
    return load_hf_processor(tiny)


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(tiny, **KNOBS)


def expect(processor, hf, conv: list[dict], out, max_tokens: int = MAX_TOKENS) -> None:
    """``out`` (ours for ``conv``) against HF's processor + generate on the raw ``conv``."""
    prompt, tokens, tops = hf_chat_greedy(hf, processor, conv, max_tokens)
    assert out.prompt_token_ids == prompt
    got = out.outputs[0]
    assert got.token_ids == tokens
    for step, (mine, ref) in enumerate(zip(got.logprobs or [], tops)):
        for tok, lp in ref.items():
            assert tok in mine and abs(mine[tok].logprob - lp) < 1e-3, (step, tok)


TEXT = [{"role": "user", "content": "Tell me a story about a cat."}]
ONE = chat("What is in this picture?", image(1, 56, 56))
TWO = chat("Compare these.", image(2, 56, 84), image(3, 112, 56))
# Qwen3-VL's processor: 32-pixel cells, 64 x 64 to 512 x 512 pixels' worth (the hub's
# budget scaled down for the tiny checkpoint)
USER_IMAGES = {
    "photo": chat("What is in this picture?", image(40, 336, 252)),  # 4:3, to 32s
    "small": chat("Read this icon.", image(41, 30, 20)),  # resized up to the minimum
    "large": chat("Describe.", image(42, 800, 600)),  # resized down into the budget
    "several": chat("Compare them.", image(43, 120, 90), image(44, 50, 300), image(45, 512, 384)),
}


def hf_ids(processor, hf, conv: list[dict]) -> list[int]:
    return hf_chat_greedy(hf, processor, conv, MAX_TOKENS)[1]


def multi_turn(answer: str) -> list[dict]:
    return ONE + [{"role": "assistant", "content": answer},
                  *chat("And this one? Compare it to the first.", image(6, 84, 84))]


def test_the_checkpoint_exercises_head_dim_and_deepstack(llm, tiny):
    with open(os.path.join(tiny, "config.json")) as f:
        cfg = json.load(f)
    text, vision = cfg["text_config"], cfg["vision_config"]
    assert text["head_dim"] != text["hidden_size"] // text["num_attention_heads"]
    core = llm.engine.core
    assert core.shape.head_dim == text["head_dim"] == core.runner.kv_caches[0][0].shape[-1]
    k = len(vision["deepstack_visual_indexes"])
    assert k >= 2 and core.shape.payload_width == text["hidden_size"] * (1 + k)


@pytest.mark.parametrize("conv", [TEXT, ONE, TWO, *USER_IMAGES.values()],
                         ids=["text", "one-image", "two-images", *USER_IMAGES])
def test_greedy_equals_hf(llm, processor, oracle, conv):
    (out,) = llm.chat(conv, GREEDY, use_tqdm=False)
    expect(processor, oracle, conv, out)


def test_images_change_the_output(llm):
    # Same text, other pixels: the tiny model must tell images apart, or the image
    # tests above would pass with the vision path (DeepStack included) broken.
    a = llm.chat(chat("Describe.", image(11, 64, 64)), GREEDY, use_tqdm=False)[0]
    b = llm.chat(chat("Describe.", image(12, 64, 64)), GREEDY, use_tqdm=False)[0]
    assert a.prompt_token_ids == b.prompt_token_ids
    assert a.outputs[0].token_ids != b.outputs[0].token_ids


def test_deepstack_matters(tiny, processor, oracle, llm):
    """With the DeepStack features zeroed in HF, its greedy ids change for some image prompt
    where ours agree with the unmodified model: the features are really injected."""
    convs = [chat(f"Describe picture {i}.", image(30 + i, 64, 96)) for i in range(4)]
    mine = [o.outputs[0].token_ids for o in llm.chat(convs, GREEDY, use_tqdm=False)]
    lm = oracle.model.language_model
    saved = lm._deepstack_process
    lm._deepstack_process = lambda h, mask, emb: h  # HF without DeepStack
    try:
        without = [hf_ids(processor, oracle, c) for c in convs]
    finally:
        lm._deepstack_process = saved
    assert without != mine
    assert [hf_ids(processor, oracle, c) for c in convs] == mine


def test_multi_turn_and_prefix_hits_across_turns(llm, processor, oracle):
    (first,) = llm.chat(ONE, GREEDY, use_tqdm=False)
    answer = llm.get_tokenizer().decode(first.outputs[0].token_ids, skip_special_tokens=True)
    conv = multi_turn(answer)
    (out,) = llm.chat(conv, GREEDY, use_tqdm=False)
    expect(processor, oracle, conv, out)
    assert out.num_cached_tokens > 0, "turn 2 must reuse turn 1's blocks (image included)"
    # every block of turn 1's prompt that is full lies inside turn 2's prompt
    assert out.num_cached_tokens >= len(first.prompt_token_ids) // 4 * 4 - 4


def test_chunked_prefill_splits_the_payload(tiny, processor, oracle):
    llm = LLM(tiny, **{**KNOBS, "max_num_batched_tokens": 8})
    conv = chat("Describe.", image(4, 128, 128))  # 16 image tokens, chunks of 8
    it = llm.processor.process_chat(conv).mm_items[0]
    assert it.offset // 8 != (it.end - 1) // 8, "the image span must straddle a chunk"
    (out,) = llm.chat(conv, GREEDY, use_tqdm=False)
    expect(processor, oracle, conv, out)
    cache = llm.engine.core.encoder.cache
    width = llm.engine.core.shape.payload_width
    assert cache.num_bytes == it.length * width * 4  # DeepStack counted in the byte bound


@pytest.mark.parametrize("layout", [
    {"encode_workers": 1, "prefill_workers": 1, "decode_workers": 1},  # E+P+D
    {"encode_workers": 1, "decode_workers": 1},  # E+PD
    {"prefill_workers": 1, "decode_workers": 1},  # P+D: the prefill worker runs the tower
], ids=["1e1p1d", "1e1d", "1p1d"])
def test_pool_layouts(tiny, processor, oracle, layout):
    """The payload goes encode -> prefilling worker over the connector (shm), checked
    against the model's payload width on arrival; chunks of 16 cut the last image's span.
    Each pool holds only the weights it runs, as its workers measure them."""
    convs = [TEXT, ONE, USER_IMAGES["several"], chat("Describe.", image(4, 128, 128))]
    want = [hf_ids(processor, oracle, c) for c in convs]
    pools = LLM(tiny, **{**KNOBS, "max_num_batched_tokens": 16}, **layout)
    try:
        outs = pools.chat(convs, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
        import time
        time.sleep(0.6)  # every worker reports its stats each 0.25 s
        s = pools.pools.stats()
        if "encode_workers" in layout:
            assert s["pool/encode/weight_bytes_language"] == 0 < s["pool/encode/weight_bytes_vision"]
        for pool in ("prefill", "decode"):
            if f"{pool}_workers" not in layout:
                continue
            lm_only = "encode_workers" in layout
            assert (s[f"pool/{pool}/weight_bytes_vision"] == 0) == lm_only
            assert s[f"pool/{pool}/weight_bytes_language"] > 0
    finally:
        pools.close()


def test_missing_deepstack_weights_fail_at_start(tiny, tmp_path):
    from safetensors.torch import load_file, save_file

    bad = str(tmp_path / "no_deepstack")
    shutil.copytree(tiny, bad)
    path = os.path.join(bad, "model.safetensors")
    tensors = {k: v for k, v in load_file(path).items() if "deepstack" not in k}
    save_file(tensors, path, metadata={"format": "pt"})
    with pytest.raises(ValueError) as e:
        LLM(bad, **KNOBS)
    msg = str(e.value)
    assert "DeepStack" in msg and "\n" not in msg


@pytest.mark.parametrize("mode", ["weights", "data"])
def test_tensor_parallel_two_ranks_in_both_encoder_modes(tiny, processor, oracle, mode):
    """TP=2: "weights" shards the tower (the DeepStack mergers too), "data" splits the
    images across ranks; either way the payload rows reach every rank with the step, and
    chunks of 16 cut the last image's span."""
    convs = [TEXT, ONE, USER_IMAGES["several"], chat("Describe.", image(4, 128, 128))]
    want = [hf_ids(processor, oracle, c) for c in convs]
    two = LLM(tiny, **{**KNOBS, "max_num_batched_tokens": 16}, tensor_parallel_size=2,
              mm_encoder_tp_mode=mode)
    try:
        outs = two.chat(convs, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
    finally:
        two.close()


def test_payload_is_one_tensor_per_item(llm):
    p = llm.processor.process_chat(TWO)
    model = llm.engine.core.model
    pixels = torch.cat([it.pixel_values for it in p.mm_items])
    grid = torch.tensor([it.grid_thw for it in p.mm_items])
    out = model.encode_images(pixels, grid)
    width = llm.engine.core.shape.payload_width
    assert [tuple(t.shape) for t in out] == [(it.length, width) for it in p.mm_items]
