"""The engine against the oracle: HF transformers end to end on the same tiny checkpoint.

The oracle runs HF's own processor (Qwen2VLProcessor / Qwen2_5_VLProcessor) on the raw
messages and images, then HF's generate (models/hf_oracle.py): prompts must be equal,
greedy token ids equal and top-5 logprobs close, for images of the shapes users send
(non-square, smaller than the minimum, large enough to be resized, several per prompt)
and every feature that can change outputs: batching, chunked prefill inside an image
span, prefix caching (and the mm-hash guard), preemption, Qwen2.5-VL's window attention.
"""
from __future__ import annotations

import os
import sys

import pytest
from PIL import Image

from triptych import LLM, SamplingParams
from triptych.models.hf_oracle import hf_chat_greedy, load_hf_model, load_hf_processor

sys.path.insert(0, os.path.dirname(__file__))
from server_fixtures import image_chat as chat  # noqa: E402
from server_fixtures import img as image  # noqa: E402

MAX_TOKENS = 6
# Qwen2-VL's processor: 28-pixel cells, 56 x 56 to 448 x 448 pixels' worth (the tiny
# checkpoint's min_pixels is the hub's, max_pixels scaled down)
USER_IMAGES = {
    "photo": chat("What is in this picture?", image(30, 336, 252)),  # 4:3, kept
    "small": chat("Read this icon.", image(31, 30, 20)),  # resized up to the minimum
    "large": chat("Describe.", image(32, 640, 480)),  # resized down into max_pixels
    "several": chat("Compare them.", image(33, 120, 90), image(34, 50, 300), image(35, 448, 448)),
}


@pytest.fixture(scope="module")
def oracle(tiny_qwen2_vl):
    """HF end to end: its processor class and its model on the checkpoint."""
    return load_hf_processor(tiny_qwen2_vl), load_hf_model(tiny_qwen2_vl)


@pytest.fixture(scope="module")
def llm(tiny_qwen2_vl):
    return LLM(tiny_qwen2_vl, block_size=4, kv_cache_memory="64MiB")


GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)


def assert_matches_oracle(llm: LLM, hf, conv: list[dict], out, max_tokens: int = MAX_TOKENS):
    """``out`` (ours for ``conv``) against HF's processor + generate on the raw ``conv``."""
    prompt, tokens, tops = hf_chat_greedy(hf[1], hf[0], conv, max_tokens)
    assert out.prompt_token_ids == prompt
    got = out.outputs[0]
    assert got.token_ids == tokens
    if got.logprobs is not None:
        for step, (mine, ref) in enumerate(zip(got.logprobs, tops)):
            for tok, lp in ref.items():
                assert tok in mine, f"step {step}: token {tok} missing from top-5"
                assert abs(mine[tok].logprob - lp) < 1e-3, (step, tok, mine[tok].logprob, lp)


def test_text_only(llm, oracle):
    conv = [{"role": "user", "content": "Tell me a story about a cat."}]
    (out,) = llm.chat(conv, GREEDY, use_tqdm=False)
    assert_matches_oracle(llm, oracle, conv, out)


def test_one_image(llm, oracle):
    conv = chat("What is in this picture?", image(1, 56, 56))
    (out,) = llm.chat(conv, GREEDY, use_tqdm=False)
    assert_matches_oracle(llm, oracle, conv, out)


def test_two_images_of_different_sizes(llm, oracle):
    conv = chat("Compare these.", image(2, 56, 84), image(3, 112, 56))
    (out,) = llm.chat(conv, GREEDY, use_tqdm=False)
    assert len(llm.processor.process_chat(conv).mm_items) == 2
    assert_matches_oracle(llm, oracle, conv, out)


@pytest.mark.parametrize("name", list(USER_IMAGES))
def test_images_of_the_shapes_users_send(llm, oracle, name):
    (out,) = llm.chat(USER_IMAGES[name], GREEDY, use_tqdm=False)
    assert_matches_oracle(llm, oracle, USER_IMAGES[name], out)


def test_sixteen_mixed_requests_batched(tiny_qwen2_vl, oracle):
    llm = LLM(tiny_qwen2_vl, block_size=4, max_num_seqs=16)
    convs, params = [], []
    for i in range(16):
        imgs = [image(10 + i, 28 * (1 + i % 3), 56)] if i % 4 else []
        convs.append(chat(f"Request number {i}: " + "words " * (i % 5), *imgs))
        params.append(SamplingParams(temperature=0.0, max_tokens=2 + i % 5, ignore_eos=True))
    outs = llm.chat(convs, params, use_tqdm=False)
    assert [len(o.outputs[0].token_ids) for o in outs] == [2 + i % 5 for i in range(16)]
    for conv, out, sp in zip(convs, outs, params):
        assert_matches_oracle(llm, oracle, conv, out, sp.max_tokens)


def test_chunked_prefill_splits_image_span(tiny_qwen2_vl, oracle):
    # An 84x84 image is 9 placeholder tokens... use 112x112 (16 tokens) and a budget of 8.
    llm = LLM(tiny_qwen2_vl, block_size=4, max_num_batched_tokens=8)
    conv = chat("Describe.", image(4, 112, 112))
    p = llm.processor.process_chat(conv)
    it = p.mm_items[0]
    assert it.offset // 8 != (it.end - 1) // 8, "the image span must straddle a chunk boundary"
    (out,) = llm.chat(conv, GREEDY, use_tqdm=False)
    assert_matches_oracle(llm, oracle, conv, out)


def test_prefix_cache_reuse_and_image_guard(tiny_qwen2_vl, oracle):
    llm = LLM(tiny_qwen2_vl, block_size=4)
    conv_a = chat("What do you see in this image? Answer briefly please.", image(5, 56, 56))
    (first,) = llm.chat(conv_a, GREEDY, use_tqdm=False)
    (again,) = llm.chat(conv_a, GREEDY, use_tqdm=False)
    assert first.num_cached_tokens == 0 and again.num_cached_tokens > 0
    assert again.outputs[0].token_ids == first.outputs[0].token_ids
    assert_matches_oracle(llm, oracle, conv_a, again)
    # Same text, different image: identical prompt token ids, so only the mm hash in the
    # block hashes keeps B from reusing A's KV.
    conv_b = chat("What do you see in this image? Answer briefly please.",
                  Image.new("RGB", (56, 56), (255, 255, 255)))
    (out_b,) = llm.chat(conv_b, GREEDY, use_tqdm=False)
    assert out_b.prompt_token_ids == first.prompt_token_ids
    assert_matches_oracle(llm, oracle, conv_b, out_b)
    assert out_b.outputs[0].token_ids != first.outputs[0].token_ids, \
        "the tiny model must tell these images apart for this test to mean anything"
    # The text before the image is shared: some blocks are still reused.
    assert 0 < out_b.num_cached_tokens < again.num_cached_tokens


def test_preemption_keeps_outputs(tiny_qwen2_vl, oracle):
    # Prompts are 54 tokens (14 blocks): two fit, and both outgrow the remaining 2 blocks.
    llm = LLM(tiny_qwen2_vl, block_size=4, num_kv_blocks=30, max_num_seqs=8,
              enable_prefix_caching=False)
    convs = [chat(f"Item {i}, describe it at length.", image(20 + i, 56, 56)) for i in range(6)]
    sp = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    outs = llm.chat(convs, sp, use_tqdm=False)
    assert llm.engine.scheduler.num_preemptions_total > 0
    for conv, out in zip(convs, outs):
        assert_matches_oracle(llm, oracle, conv, out, 12)
    llm.engine.kv.check_integrity()
    assert llm.engine.kv.pool.num_free_blocks == 30


def test_qwen2_5_vl_window_attention(tiny_qwen2_5_vl):
    hf = load_hf_processor(tiny_qwen2_5_vl), load_hf_model(tiny_qwen2_5_vl)
    llm = LLM(tiny_qwen2_5_vl, block_size=4)
    # 224x224 -> 16x16 patches: several 112-pixel attention windows; windows cut unevenly
    # through a non-square photo and a resized large image
    for conv in (chat("Describe this.", image(6, 224, 224)),
                 chat("Two:", image(7, 56, 112), image(8, 140, 84)),
                 *USER_IMAGES.values(),
                 [{"role": "user", "content": "Only text here."}]):
        (out,) = llm.chat(conv, GREEDY, use_tqdm=False)
        assert_matches_oracle(llm, hf, conv, out)
