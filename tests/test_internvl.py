"""InternVL (HF format) against HF transformers end to end on a tiny `make-tiny` checkpoint.

The oracle is HF's own InternVLProcessor on the raw messages and images, then HF's
generate (models/hf_oracle.py): the checkpoint's processor files are written as the hub's
(``"crop_to_patches": false``, 1..12 tiles), and HF's processor turns the crop on for every
call, so an image becomes a grid of tiles of its aspect ratio plus a thumbnail. Prompts
(tiles per image, so placeholder counts) and greedy ids equal HF's for text only, images
of the shapes users send (non-square, small, large, several per prompt), multi-turn with
prefix-cache hits, chunked prefill through an image span, E+P+D / E+PD and TP=2; the
image's key records the crop actually used. The contract is not Qwen-shaped: 1-D
positions, <img> <IMG_CONTEXT> x N </img>, a template that knows only {"type": "image"}.
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
from triptych.models.hf_oracle import (
    hf_chat_greedy,
    hf_chat_inputs,
    hf_greedy,
    load_hf_model,
    load_hf_processor,
)
from triptych.models.internvl import unpatchify

sys.path.insert(0, os.path.dirname(__file__))
from server_fixtures import image_chat as chat
from server_fixtures import img as image

MAX_TOKENS = 6
GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=5)
KNOBS = {"block_size": 4, "kv_cache_memory": "64MiB", "max_model_len": 1024}

TEXT = [{"role": "user", "content": "Tell me a story about a cat."}]
# 56-pixel tiles, 4 rows each: HF makes 4x3 tiles + a thumbnail of this 4:3 photo
PHOTO = chat("What is in this picture?", image(1, 336, 252))
CONVS = {
    "text": TEXT,
    "photo": PHOTO,
    "small": chat("Read this.", image(2, 30, 40)),  # smaller than a tile
    "wide": chat("What is written here?", image(3, 170, 56)),  # a line of text
    "large": chat("Describe.", image(4, 1280, 720)),  # resized into at most 12 tiles
    "square": chat("Describe.", image(5, 56, 56)),  # exactly one tile, no thumbnail
    "several": chat("Compare these.", image(6, 56, 56), image(7, 120, 56), image(8, 90, 160)),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    from triptych.models.tiny import make_tiny

    return make_tiny("internvl", str(tmp_path_factory.mktemp("tiny") / "internvl"), seed=0)


@pytest.fixture(scope="module")
def hf(tiny):
    """HF end to end: its processor class and its model on the checkpoint."""
    return load_hf_processor(tiny), load_hf_model(tiny)


@pytest.fixture(scope="module")
def llm(tiny):
    engine = LLM(tiny, **KNOBS)
    yield engine
    engine.close()


def hf_ids(hf, conv: list[dict]) -> list[int]:
    return hf_chat_greedy(hf[1], hf[0], conv, MAX_TOKENS)[1]


def expect(hf, conv: list[dict], out) -> None:
    """Our prompt and greedy ids are HF's, our top logprobs within 1e-3 of HF's."""
    prompt, tokens, tops = hf_chat_greedy(hf[1], hf[0], conv, MAX_TOKENS)
    assert out.prompt_token_ids == prompt
    assert out.outputs[0].token_ids == tokens
    for step, (mine, ref) in enumerate(zip(out.outputs[0].logprobs or [], tops, strict=False)):
        for tok, lp in ref.items():
            assert tok in mine and abs(mine[tok].logprob - lp) < 1e-3, (step, tok)


def test_the_checkpoint_is_written_as_the_hubs(tiny, hf):
    """The file says crop_to_patches false (as the hub's do); HF's processor crops anyway."""
    with open(os.path.join(tiny, "preprocessor_config.json")) as f:
        cfg = json.load(f)
    assert cfg["crop_to_patches"] is False and (cfg["min_patches"], cfg["max_patches"]) == (1, 12)
    assert hf[0].image_processor.crop_to_patches is False
    assert hf_chat_inputs(hf[0], PHOTO)["pixel_values"].shape[0] == 13


@pytest.mark.parametrize("name", [n for n in CONVS if n != "text"])
def test_tiles_and_pixels_are_hfs(llm, hf, name):
    """Each image's tiles (count and pixels) and the expanded prompt are HF's processor's."""
    p = llm.processor.process_chat(CONVS[name])
    ref = hf_chat_inputs(hf[0], CONVS[name])
    assert p.prompt_token_ids == ref["input_ids"][0].tolist()
    tiles = torch.cat([unpatchify(it.pixel_values, *it.grid_thw[:2], 14) for it in p.mm_items])
    assert torch.equal(tiles, ref["pixel_values"])
    tok = llm.get_tokenizer()
    start, end, ctx = (tok.convert_tokens_to_ids(t) for t in ("<img>", "</img>", "<IMG_CONTEXT>"))
    for it in p.mm_items:
        ids = p.prompt_token_ids
        assert ids[it.offset - 1] == start and ids[it.end] == end
        assert set(ids[it.offset:it.end]) == {ctx} and it.length == it.grid_thw[0] * 4


def test_non_square_images_are_tiled(llm):
    """A non-square image is many tiles (a grid of its aspect + a thumbnail), not one."""
    counts = {n: [it.grid_thw[0] for it in llm.processor.process_chat(c).mm_items]
              for n, c in CONVS.items()}
    assert counts["photo"] == [13] and counts["square"] == [1]
    assert counts["wide"][0] > 1 and counts["large"][0] > 1 and counts["several"][1:] != [1, 1]


@pytest.mark.parametrize("name", list(CONVS))
def test_greedy_equals_hf(llm, hf, name):
    (out,) = llm.chat(CONVS[name], GREEDY, use_tqdm=False)
    expect(hf, CONVS[name], out)


def test_the_bench_peer_builds_internvl_inputs(llm, hf):
    """models/hf_oracle's model-side path (the bench's HF peer) gives HF's class our tiles:
    since they are HF's processor's, its ids are HF's end to end."""
    p = llm.processor.process_chat(CONVS["several"])
    pad = llm.get_tokenizer().pad_token_id
    assert hf_greedy(hf[1], p, MAX_TOKENS, pad)[0] == hf_ids(hf, CONVS["several"])


def test_images_change_the_output(llm):
    a = llm.chat(chat("Describe.", image(11, 64, 64)), GREEDY, use_tqdm=False)[0]
    b = llm.chat(chat("Describe.", image(12, 64, 64)), GREEDY, use_tqdm=False)[0]
    assert a.prompt_token_ids == b.prompt_token_ids
    assert a.outputs[0].token_ids != b.outputs[0].token_ids


def test_image_url_parts_reach_an_image_only_template(llm, hf):
    """The template knows only {"type": "image"}: an OpenAI image_url part must still
    become an image (converted for the template), not vanish from the prompt."""
    buf = io.BytesIO()
    image(1, 336, 252).save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    conv = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "What is in this picture?"}]}]
    (out,) = llm.chat(conv, GREEDY, use_tqdm=False)
    expect(hf, PHOTO, out)  # HF's form of the same message: the PIL image


def test_multi_turn_and_prefix_hits_across_turns(llm, hf):
    (first,) = llm.chat(PHOTO, GREEDY, use_tqdm=False)
    answer = llm.get_tokenizer().decode(first.outputs[0].token_ids, skip_special_tokens=True)
    conv = PHOTO + [{"role": "assistant", "content": answer},
                    *chat("And this one?", image(6, 200, 84))]
    (out,) = llm.chat(conv, GREEDY, use_tqdm=False)
    expect(hf, conv, out)
    assert out.num_cached_tokens >= len(first.prompt_token_ids) // 4 * 4 - 4


def test_chunked_prefill_splits_an_image_span(tiny, hf):
    small = LLM(tiny, **{**KNOBS, "max_num_batched_tokens": 8})
    try:
        conv = CONVS["wide"]
        it = small.processor.process_chat(conv).mm_items[0]
        assert it.offset // 8 != (it.end - 1) // 8, "the image span must straddle a chunk"
        (out,) = small.chat(conv, GREEDY, use_tqdm=False)
        expect(hf, conv, out)
    finally:
        small.close()


@pytest.mark.parametrize("layout", [
    {"encode_workers": 1, "prefill_workers": 1, "decode_workers": 1},  # E+P+D
    {"encode_workers": 1, "decode_workers": 1},  # E+PD
], ids=["1e1p1d", "1e1d"])
def test_encode_prefill_decode_pools(tiny, hf, layout):
    """1e1p1d and E+PD: the tiles are encoded in the encode pool and their rows travel the
    connector to the prefilling worker; chunks of 8 cut the image spans."""
    convs = [CONVS[n] for n in ("text", "photo", "several")]
    want = [hf_ids(hf, c) for c in convs]
    pools = LLM(tiny, **{**KNOBS, "max_num_batched_tokens": 8}, **layout)
    try:
        outs = pools.chat(convs, GREEDY, use_tqdm=False)
        assert [o.outputs[0].token_ids for o in outs] == want
    finally:
        pools.close()


def test_keys_record_the_tiling_settings_used(tiny, tmp_path):
    """The key holds the crop actually used (on, whatever the file says) and every tiling
    setting: fewer max_patches, different tiles, a different key."""
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
    ours = InputProcessor(tiny)
    assert ours.image_processor.crop_to_patches is False  # the file's value ...
    assert ours.image_hash_kwargs["crop_to_patches"] is True  # ... and the one used
    a = ours.process_chat(chat("Hi.", pic)).mm_items[0]
    b = InputProcessor(other).process_chat(chat("Hi.", pic)).mm_items[0]
    assert a.grid_thw[0] != b.grid_thw[0]
    assert a.mm_hash != b.mm_hash


@pytest.mark.parametrize("mode", ["weights", "data"])
def test_tensor_parallel_two_ranks(tiny, hf, mode):
    """TP=2 shards the language model (the tower stays whole: "weights" encodes every image
    on each rank, "data" splits the images); chunks of 8 cut the image spans."""
    convs = [TEXT, CONVS["several"]]
    want = [hf_ids(hf, c) for c in convs]
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
    p = llm.processor.process_chat(CONVS["several"])
    pixels = torch.cat([it.pixel_values for it in p.mm_items])
    grid = torch.tensor([it.grid_thw for it in p.mm_items])
    mine = vision.encode_images(pixels, grid)
    whole = llm.engine.core.model.encode_images(pixels, grid)
    assert [tuple(t.shape) for t in mine] == [(it.length, 64) for it in p.mm_items]
    assert all(torch.equal(a, b) for a, b in zip(mine, whole, strict=True))


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


def test_qwen3_decoder_equals_hf(tmp_path_factory):
    """InternVL3.5's decoder (Qwen3: q/k norm, head_dim twice hidden / heads) with 1-D
    RoPE: text only and several images of different tile counts."""
    from triptych.models.tiny_internvl import make_tiny_internvl

    tiny3 = make_tiny_internvl(str(tmp_path_factory.mktemp("tiny") / "internvl3_5"),
                               text_arch="qwen3")
    hf = load_hf_processor(tiny3), load_hf_model(tiny3)
    engine = LLM(tiny3, **KNOBS)
    try:
        assert engine.engine.core.shape.head_dim == hf[1].config.text_config.head_dim == 32
        for name in ("text", "photo", "several"):
            (out,) = engine.chat(CONVS[name], GREEDY, use_tqdm=False)
            expect(hf, CONVS[name], out)
    finally:
        engine.close()
