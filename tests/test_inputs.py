"""make-tiny checkpoints load with HF's Auto classes; prompts in every offline form."""
from __future__ import annotations

import base64
import io

import numpy as np
import pytest
from PIL import Image

from triptych import LLM, SamplingParams
from triptych.mmcache.hashing import hash_image

SP = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)


def img(seed: int, w: int = 56, h: int = 56) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def llm(tiny_qwen2_vl):
    return LLM(tiny_qwen2_vl, block_size=4)


def test_auto_classes_load_offline(tiny_qwen2_vl, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    from transformers import (AutoConfig, AutoImageProcessor, AutoModelForImageTextToText,
                              AutoTokenizer)

    cfg = AutoConfig.from_pretrained(tiny_qwen2_vl)
    tok = AutoTokenizer.from_pretrained(tiny_qwen2_vl)
    assert tok.convert_tokens_to_ids("<|image_pad|>") == cfg.image_token_id
    assert tok.eos_token == "<|im_end|>"
    model = AutoModelForImageTextToText.from_pretrained(tiny_qwen2_vl)
    assert type(model).__name__ == "Qwen2VLForConditionalGeneration"
    ip = AutoImageProcessor.from_pretrained(tiny_qwen2_vl)
    out = ip(images=[img(0, 224, 224)], return_tensors="pt")
    assert out["image_grid_thw"].tolist() == [[1, 16, 16]]  # 224x224 keeps its size
    text = tok.apply_chat_template([{"role": "user", "content": [
        {"type": "image"}, {"type": "text", "text": "hi"}]}], tokenize=False,
        add_generation_prompt=True)
    assert "<|vision_start|><|image_pad|><|vision_end|>hi<|im_end|>" in text
    assert text.endswith("<|im_start|>assistant\n")


def test_placeholder_expansion_matches_grid(llm):
    p = llm.processor.process_chat([{"role": "user", "content": [
        {"type": "image", "image": img(1, 84, 56)}, {"type": "text", "text": "and"},
        {"type": "image", "image": img(2, 112, 112)}]}])
    a, b = p.mm_items
    assert a.grid_thw == (1, 4, 6) and a.length == 6 and b.grid_thw == (1, 8, 8) and b.length == 16
    ids = p.prompt_token_ids
    image_id = llm.engine.shape.image_token_id
    assert ids[a.offset:a.end] == [image_id] * 6 and ids[b.offset:b.end] == [image_id] * 16
    assert ids.count(image_id) == 22 and a.pixel_values.shape[0] == 24


def test_mm_hash_covers_shape_and_kwargs():
    data = np.random.default_rng(0).integers(0, 256, (30, 100, 3), dtype=np.uint8)
    wide = Image.fromarray(data)
    tall = Image.fromarray(data.reshape(100, 30, 3))  # same bytes, other shape
    assert wide.tobytes() == tall.tobytes()
    assert hash_image(wide, {}) != hash_image(tall, {})
    assert hash_image(wide, {"max_pixels": 1}) != hash_image(wide, {"max_pixels": 2})
    assert hash_image(wide, {"a": 1}) == hash_image(Image.fromarray(data.copy()), {"a": 1})


def test_prompt_forms_agree(llm):
    im = img(3)
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    url = "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()
    conv = [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": "Describe."}]}]
    (via_url,) = llm.chat(conv, SP, use_tqdm=False)
    conv_pil = [{"role": "user", "content": [{"type": "image", "image": im},
                                             {"type": "text", "text": "Describe."}]}]
    (via_pil,) = llm.chat(conv_pil, SP, use_tqdm=False)
    text = llm.get_tokenizer().apply_chat_template(conv_pil, tokenize=False,
                                                   add_generation_prompt=True)
    (via_dict,) = llm.generate({"prompt": text, "multi_modal_data": {"image": im}}, SP,
                               use_tqdm=False)
    (via_ids,) = llm.generate([via_pil.prompt_token_ids[:5]], SP, use_tqdm=False)
    assert via_url.outputs[0].token_ids == via_pil.outputs[0].token_ids == \
        via_dict.outputs[0].token_ids
    assert via_url.prompt_token_ids == via_dict.prompt_token_ids
    assert via_ids.prompt_token_ids == via_pil.prompt_token_ids[:5]
    (via_str,) = llm.generate("Hello there", SP, use_tqdm=False)
    assert len(via_str.outputs[0].token_ids) == 4 and via_str.outputs[0].finish_reason == "length"


def test_placeholder_count_mismatch_is_an_error(llm):
    with pytest.raises(ValueError, match="placeholders"):
        llm.generate({"prompt": "no placeholder here", "multi_modal_data": {"image": img(4)}},
                     SP, use_tqdm=False)


def test_n_and_seeded_sampling(llm):
    sp = SamplingParams(temperature=1.0, max_tokens=8, n=3, seed=7, ignore_eos=True)
    (a,) = llm.generate("Tell me something", sp, use_tqdm=False)
    (b,) = llm.generate("Tell me something", sp, use_tqdm=False)
    assert [c.index for c in a.outputs] == [0, 1, 2]
    assert [c.token_ids for c in a.outputs] == [c.token_ids for c in b.outputs]
    assert len({tuple(c.token_ids) for c in a.outputs}) > 1  # each completion samples its own


def test_stop_string_and_eos(llm):
    (ref,) = llm.generate("Once upon a time", SamplingParams(temperature=0.0, max_tokens=12,
                                                             ignore_eos=True), use_tqdm=False)
    text = ref.outputs[0].text
    # Two characters from the middle on that are not all whitespace (the greedy text of the
    # seeded tiny model is fixed: no such pair would be a failure, never a skip).
    i = next(i for i in range(len(text) // 2, len(text) - 1) if text[i:i + 2].strip())
    stop = text[i:i + 2]
    (out,) = llm.generate("Once upon a time", SamplingParams(temperature=0.0, max_tokens=12,
                                                             stop=[stop], ignore_eos=True),
                          use_tqdm=False)
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop
    assert out.outputs[0].text == text[:text.index(stop)]


def test_one_pixel_image_is_served(llm):
    # A 1x1 image once crashed an engine (CVE-2026-22773): it is resized up to the
    # processor's minimum (56x56 here) and served like any other.
    conv = [{"role": "user", "content": [{"type": "image", "image": Image.new("RGB", (1, 1))},
                                         {"type": "text", "text": "dot?"}]}]
    (out,) = llm.chat(conv, SP, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 4
    assert llm.processor.process_chat(conv).mm_items[0].grid_thw == (1, 4, 4)


def test_repeated_image_skips_the_vision_tower(llm):
    im = img(42)

    def conv(q: str, image_first: bool) -> list[dict]:
        parts = [{"type": "image", "image": im}, {"type": "text", "text": q}]
        return [{"role": "user", "content": parts if image_first else parts[::-1]}]

    enc = llm.engine.encoder
    n0, h0 = enc.num_items_encoded, enc.cache.num_hits
    llm.chat(conv("first question", True), SP, use_tqdm=False)
    assert enc.num_items_encoded == n0 + 1
    # Same image after a different question: the prefix differs, the encoder cache hits.
    llm.chat(conv("a different question entirely", False), SP, use_tqdm=False)
    assert enc.num_items_encoded == n0 + 1 and enc.cache.num_hits == h0 + 1
    # Image first again, new question: its KV comes from the prefix cache, so the
    # encoder is not even asked.
    (out,) = llm.chat(conv("yet another one", True), SP, use_tqdm=False)
    assert out.num_cached_tokens > 16
    assert enc.num_items_encoded == n0 + 1 and enc.cache.num_hits == h0 + 1
