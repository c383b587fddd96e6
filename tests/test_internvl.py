"""InternVL (HF format) against HF transformers' own model on a tiny `make-tiny` checkpoint.

The contract is not Qwen-shaped here: 1-D positions, an image is several tiles (dynamic
crops + a thumbnail) wrapped as <img> <IMG_CONTEXT> x N </img>, GotOcr2's processor, and a
chat template that knows only {"type": "image"} parts. Greedy ids equal HF's for text only,
one image, two images with different tile counts, multi-turn with prefix-cache hits;
chunked prefill through an image span; E+P+D; keys cover the tiling settings.
"""
from __future__ import annotations

import base64
import io
import json
import os
import shutil
import sys

import pytest
import torch
from triptych import LLM, SamplingParams
from triptych.models.hf_oracle import load_hf_model, no_eos
from triptych.models.internvl import unpatchify

sys.path.insert(0, os.path.dirname(__file__))
from server_fixtures import image_chat as chat
from server_fixtures import img as image

MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
KNOBS = {"block_size": 4, "kv_cache_memory": "64MiB", "max_model_len": 512}

TEXT = [{"role": "user", "content": "Tell me a story about a cat."}]
ONE = chat("What is in this picture?", image(1, 120, 56))  # 2 crops + thumbnail
TWO = chat("Compare these.", image(2, 56, 56), image(3, 170, 56))  # 1 tile, 3 + thumbnail


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    from triptych.models.tiny import make_tiny

    return make_tiny("internvl", str(tmp_path_factory.mktemp("tiny") / "internvl"), seed=0)


@pytest.fixture(scope="module")
def oracle(tiny):
    model = load_hf_model(tiny)
    no_eos(model)
    return model


@pytest.fixture(scope="module")
def llm(tiny):
    return LLM(tiny, **KNOBS)


@torch.inference_mode()
def hf_ids(hf, prompt) -> list[int]:
    """HF's greedy ids for our processed prompt (its tiles rebuilt from the flat patches)."""
    inp = {"input_ids": torch.tensor([prompt.prompt_token_ids])}
    if prompt.mm_items:
        inp["pixel_values"] = torch.cat([unpatchify(it.pixel_values, *it.grid_thw[:2], 14)
                                         for it in prompt.mm_items])
    out = hf.generate(**inp, max_new_tokens=MAX_TOKENS, do_sample=False)
    return out[0, len(prompt.prompt_token_ids):].tolist()


def expect(llm: LLM, hf, conv: list[dict], out) -> None:
    processed = llm.processor.process_chat(conv)
    assert out.prompt_token_ids == processed.prompt_token_ids
    assert out.outputs[0].token_ids == hf_ids(hf, processed)


def test_prompt_matches_hf_processor_layout(llm):
    p = llm.processor.process_chat(TWO)
    tok = llm.get_tokenizer()
    start, end, ctx = (tok.convert_tokens_to_ids(t) for t in ("<img>", "</img>", "<IMG_CONTEXT>"))
    assert [it.grid_thw[0] for it in p.mm_items] == [1, 4]  # tiles per image differ
    for it in p.mm_items:
        ids = p.prompt_token_ids
        assert ids[it.offset - 1] == start and ids[it.end] == end
        assert set(ids[it.offset:it.end]) == {ctx} and it.length == it.grid_thw[0] * 4


@pytest.mark.parametrize("conv", [TEXT, ONE, TWO], ids=["text", "one-image", "two-images"])
def test_greedy_equals_hf(llm, oracle, conv):
    (out,) = llm.chat(conv, GREEDY, use_tqdm=False)
    expect(llm, oracle, conv, out)


def test_the_shared_oracle_builds_internvl_inputs(llm, oracle):
    """models/hf_oracle (the bench's HF peer too) gives HF's class its tiles."""
    from triptych.models.hf_oracle import hf_greedy

    p = llm.processor.process_chat(TWO)
    assert hf_greedy(oracle, p, MAX_TOKENS, llm.get_tokenizer().pad_token_id)[0] == \
        hf_ids(oracle, p)


def test_images_change_the_output(llm):
    a = llm.chat(chat("Describe.", image(11, 64, 64)), GREEDY, use_tqdm=False)[0]
    b = llm.chat(chat("Describe.", image(12, 64, 64)), GREEDY, use_tqdm=False)[0]
    assert a.prompt_token_ids == b.prompt_token_ids
    assert a.outputs[0].token_ids != b.outputs[0].token_ids


def test_image_url_parts_reach_an_image_only_template(llm, oracle):
    """The template knows only {"type": "image"}: an OpenAI image_url part must still
    become an image (converted for the template), not vanish from the prompt."""
    buf = io.BytesIO()
    image(1, 120, 56).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    conv = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "What is in this picture?"}]}]
    p = llm.processor.process_chat(conv)
    assert len(p.mm_items) == 1 and p.mm_items[0].grid_thw[0] == 3
    (out,) = llm.chat(conv, GREEDY, use_tqdm=False)
    assert out.outputs[0].token_ids == hf_ids(oracle, p)
    # the same pixels as a PIL part: same prompt ids
    assert p.prompt_token_ids == llm.processor.process_chat(ONE).prompt_token_ids


def test_multi_turn_and_prefix_hits_across_turns(llm, oracle):
    (first,) = llm.chat(ONE, GREEDY, use_tqdm=False)
    answer = llm.get_tokenizer().decode(first.outputs[0].token_ids, skip_special_tokens=True)
    conv = ONE + [{"role": "assistant", "content": answer},
                  *chat("And this one?", image(6, 84, 84))]
    (out,) = llm.chat(conv, GREEDY, use_tqdm=False)
    expect(llm, oracle, conv, out)
    assert out.num_cached_tokens >= len(first.prompt_token_ids) // 4 * 4 - 4


def test_chunked_prefill_splits_an_image_span(tiny, oracle):
    small = LLM(tiny, **{**KNOBS, "max_num_batched_tokens": 8})
    try:
        conv = chat("Describe.", image(4, 170, 56))  # 16 image rows, chunks of 8
        it = small.processor.process_chat(conv).mm_items[0]
        assert it.offset // 8 != (it.end - 1) // 8, "the image span must straddle a chunk"
        (out,) = small.chat(conv, GREEDY, use_tqdm=False)
        expect(small, oracle, conv, out)
    finally:
        small.close()


@pytest.mark.parametrize("layout", [
    {"encode_workers": 1, "prefill_workers": 1, "decode_workers": 1},  # E+P+D
    {"encode_workers": 1, "decode_workers": 1},  # E+PD
], ids=["1e1p1d", "1e1d"])
def test_encode_prefill_decode_pools(tiny, oracle, llm, layout):
    """1e1p1d and E+PD: the tiles are encoded in the encode pool and their rows travel the
    connector to the prefilling worker; chunks of 8 cut the image spans."""
    convs = [TEXT, ONE, TWO]
    want = [hf_ids(oracle, llm.processor.process_chat(c)) for c in convs]
    pools = LLM(tiny, **{**KNOBS, "max_num_batched_tokens": 8}, **layout)
    try:
        outs = pools.chat(convs, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
    finally:
        pools.close()


def test_keys_cover_the_tiling_settings(tiny, tmp_path):
    from triptych.api.processor import InputProcessor

    other = str(tmp_path / "two_tiles")
    shutil.copytree(tiny, other)
    path = os.path.join(other, "preprocessor_config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["max_patches"] = 2
    with open(path, "w") as f:
        json.dump(cfg, f)
    pic = image(5, 170, 56)
    a = InputProcessor(tiny).process_chat(chat("Hi.", pic)).mm_items[0]
    b = InputProcessor(other).process_chat(chat("Hi.", pic)).mm_items[0]
    assert a.grid_thw[0] != b.grid_thw[0]
    assert a.mm_hash != b.mm_hash


@pytest.mark.parametrize("mode", ["weights", "data"])
def test_tensor_parallel_two_ranks(tiny, oracle, llm, mode):
    """TP=2 shards the language model (the tower stays whole: "weights" encodes every image
    on each rank, "data" splits the images); chunks of 8 cut the image spans."""
    convs = [TEXT, TWO]
    want = [hf_ids(oracle, llm.processor.process_chat(c)) for c in convs]
    two = LLM(tiny, **{**KNOBS, "max_num_batched_tokens": 8}, tensor_parallel_size=2,
              mm_encoder_tp_mode=mode)
    try:
        outs = two.chat(convs, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
    finally:
        two.close()


def test_each_part_loads_only_its_weights(tiny, llm):
    """An encode worker's model (vision) holds no LM weights and a language-only one no
    tower, yet the vision part alone gives the same payloads as the whole model."""
    from triptych.models.loader import load_model
    from triptych.models.weight_parts import weight_bytes

    vision, _ = load_model(tiny, torch.float32, "cpu", parts="vision")
    language, _ = load_model(tiny, torch.float32, "cpu", parts="language")
    assert weight_bytes(vision)["language"] == 0 < weight_bytes(vision)["vision"]
    assert weight_bytes(language)["vision"] == 0 < weight_bytes(language)["language"]
    p = llm.processor.process_chat(TWO)
    pixels = torch.cat([it.pixel_values for it in p.mm_items])
    grid = torch.tensor([it.grid_thw for it in p.mm_items])
    mine = vision.encode_images(pixels, grid)
    whole = llm.engine.core.model.encode_images(pixels, grid)
    assert [tuple(t.shape) for t in mine] == [(it.length, 64) for it in p.mm_items]
    assert all(torch.equal(a, b) for a, b in zip(mine, whole))


def test_a_config_the_contract_cannot_serve_fails_at_start(tiny, tmp_path):
    bad = str(tmp_path / "bad_layer")
    shutil.copytree(tiny, bad)
    path = os.path.join(bad, "config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["vision_feature_layer"] = -2
    with open(path, "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError) as e:
        LLM(bad, **KNOBS)
    assert "vision_feature_layer" in str(e.value) and "\n" not in str(e.value)


@pytest.fixture(scope="module")
def tiny3(tmp_path_factory) -> str:
    from triptych.models.tiny_internvl import make_tiny_internvl

    return make_tiny_internvl(str(tmp_path_factory.mktemp("tiny") / "internvl3_5"),
                              text_arch="qwen3")


def test_qwen3_decoder_equals_hf(tiny3):
    """InternVL3.5's decoder (Qwen3: q/k norm, head_dim twice hidden / heads) with 1-D
    RoPE: text only and two images of different tile counts."""
    hf = load_hf_model(tiny3)
    no_eos(hf)
    engine = LLM(tiny3, **KNOBS)
    try:
        assert engine.engine.core.shape.head_dim == hf.config.text_config.head_dim == 32
        for conv in (TEXT, TWO):
            (out,) = engine.chat(conv, GREEDY, use_tqdm=False)
            expect(engine, hf, conv, out)
    finally:
        engine.close()
