"""P0's processor path with a ProcessorCacheIndex: a repeated image costs a hash, uuids."""
from __future__ import annotations

import base64
import io
import json
import shutil
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

import triptych.api.media_items as processor_mod  # where items are decoded and preprocessed
from triptych.api.media.decode import MediaLimits
from triptych.api.processor import InputProcessor
from triptych.mmcache import ProcessorCacheIndex


class Counting:
    """Counts the model contract's image preprocessing runs (the real one runs: the fast
    path or HF's processor, as --mm-preprocessor says; every attribute passes through)."""

    def __init__(self, inner: Any) -> None:
        self.inner, self.calls = inner, 0

    def preprocess_image(self, *args: Any, **kwargs: Any) -> Any:
        self.calls += 1
        return self.inner.preprocess_image(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)


def img(seed: int, w: int = 56, h: int = 56) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def png(im: Image.Image) -> bytes:
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return buf.getvalue()


def data_url(im: Image.Image) -> str:
    return "data:image/png;base64," + base64.b64encode(png(im)).decode()


def chat(*parts: dict, text: str = "What is this?") -> list[dict]:
    return [{"role": "user", "content": [*parts, {"type": "text", "text": text}]}]


def image_part(src: Any, uuid: str | None = None, key: str = "url") -> dict:
    part: dict[str, Any] = {"type": "image_url", "image_url": {key: src} if src is not None
                            else None}
    if uuid is not None:
        part["uuid"] = uuid
    return part


def make(model_dir: str, tmp_path, cache: ProcessorCacheIndex | None) -> InputProcessor:
    p = InputProcessor(model_dir, limit_mm_per_prompt={"image": 3, "video": 1},
                       media_limits=MediaLimits(allowed_local_media_path=str(tmp_path)),
                       max_model_len=4096, cache=cache)
    p.contract = Counting(p.contract)
    return p


@pytest.fixture
def cproc(tiny_qwen2_vl, tmp_path) -> InputProcessor:
    return make(tiny_qwen2_vl, tmp_path, ProcessorCacheIndex(64 << 20))


@pytest.fixture
def decodes(monkeypatch) -> list[int]:
    calls = [0]
    real = processor_mod.decode_image

    def counting(*a: Any, **k: Any) -> Image.Image:
        calls[0] += 1
        return real(*a, **k)

    monkeypatch.setattr(processor_mod, "decode_image", counting)
    return calls


def test_repeated_image_costs_no_processor_run(cproc, tiny_qwen2_vl, tmp_path, decodes):
    im = img(1, 84, 56)
    path = tmp_path / "one.png"
    path.write_bytes(png(im))
    first = cproc.process_chat(chat(image_part(data_url(im))))
    assert cproc.contract.calls == 1 and decodes[0] == 1
    (a,) = first.mm_items
    assert a.pixel_values is not None

    again = cproc.process_chat(chat(image_part(data_url(im))))
    as_file = cproc.process_chat(chat(image_part(str(path)), text="Another prompt entirely."))
    assert cproc.contract.calls == 1 and decodes[0] == 1  # a hash, nothing else
    assert again.prompt_token_ids == first.prompt_token_ids
    for p in (again, as_file):
        (b,) = p.mm_items
        assert (b.mm_hash, b.grid_thw, b.length, b.modality) == \
            (a.mm_hash, a.grid_thw, a.length, a.modality)
        assert b.pixel_values is None
        assert p.prompt_token_ids[b.offset:b.end] == [cproc.image_token_id] * b.length
    assert again.mm_items[0].offset == a.offset
    # Hit or miss, the router learns the pixels' dtype/shape/size without the pixels.
    for p in (first, again, as_file):
        meta = p.mm_sources[0].meta
        assert meta.matches(a.pixel_values) and meta.nbytes == a.pixel_values.numel() * 4

    # The prompt equals what a processor without any cache builds.
    plain = make(tiny_qwen2_vl, tmp_path, None)
    assert plain.process_chat(chat(image_part(data_url(im)))).prompt_token_ids == \
        first.prompt_token_ids

    # The router can still get the pixels when the chosen worker lacks them.
    pv = cproc.load_pixels(as_file.mm_items[0], as_file.mm_sources[0])
    assert torch.equal(pv, a.pixel_values) and as_file.mm_items[0].pixel_values is pv
    assert cproc.contract.calls == 2
    s = cproc.stats()
    assert (s["mm_processor_cache_queries"], s["mm_processor_cache_hits"]) == (3, 2)
    assert s["mm_processor_cache_index_entries"] == 1
    assert s["mm_processor_cache_index_bytes"] == a.pixel_values.numel() * 4


def test_different_images_in_the_same_place_share_nothing(cproc):
    a = cproc.process_chat(chat(image_part(data_url(img(2))))).mm_items[0]
    b = cproc.process_chat(chat(image_part(data_url(img(3))))).mm_items[0]
    assert a.mm_hash != b.mm_hash and b.pixel_values is not None
    assert not torch.equal(a.pixel_values, b.pixel_values)
    assert cproc.contract.calls == 2 and cproc.stats()["mm_processor_cache_hits"] == 0


def test_repeated_video_skips_preprocessing(cproc, monkeypatch):
    calls = [0]
    real = processor_mod.preprocess_video

    def counting(*a: Any, **k: Any) -> Any:
        calls[0] += 1
        return real(*a, **k)

    monkeypatch.setattr(processor_mod, "preprocess_video", counting)
    frames = np.random.default_rng(4).integers(0, 256, (2, 56, 84, 3), dtype=np.uint8)
    conv = [{"role": "user", "content": [{"type": "video", "video": frames}]}]
    (a,) = cproc.process_chat(conv).mm_items
    p = cproc.process_chat(conv)
    (b,) = p.mm_items
    assert calls[0] == 1 and b.pixel_values is None
    assert (b.grid_thw, b.length, b.second_per_grid_t) == (a.grid_thw, a.length,
                                                           a.second_per_grid_t)
    assert torch.equal(cproc.load_pixels(b, p.mm_sources[0]), a.pixel_values)


def test_uuid_names_the_item(cproc, tmp_path):
    im = img(5, 112, 56)
    path = tmp_path / "five.png"
    path.write_bytes(png(im))
    first = cproc.process_chat(chat(image_part(data_url(im), uuid="cat-1")))
    (a,) = first.mm_items
    assert cproc.contract.calls == 1
    by_bytes = cproc.process_chat(chat(image_part(data_url(im)))).mm_items[0]
    assert by_bytes.mm_hash != a.mm_hash  # the uuid, not the bytes, is this item's key

    # Only the uuid: answered as if the image were sent.
    for part in (image_part(None, "cat-1"), {"type": "image_url", "image_url": {},
                                              "uuid": "cat-1"},
                 {"type": "image", "image": None, "uuid": "cat-1"}):
        p = cproc.process_chat(chat(part))
        (b,) = p.mm_items
        assert p.prompt_token_ids == first.prompt_token_ids
        assert (b.mm_hash, b.grid_thw, b.length, b.pixel_values) == \
            (a.mm_hash, a.grid_thw, a.length, None)
        with pytest.raises(ValueError, match="no longer cached"):
            cproc.load_pixels(b, p.mm_sources[0])  # nothing to make the pixels from
    assert cproc.contract.calls == 2  # only the by-bytes request ran it

    # A uuid hit with data does not fetch it; the router can still produce the pixels.
    p = cproc.process_chat(chat(image_part(str(path), "cat-1")))
    assert p.mm_sources[0].payload == str(path) and cproc.contract.calls == 2
    assert torch.equal(cproc.load_pixels(p.mm_items[0], p.mm_sources[0]), a.pixel_values)

    with pytest.raises(ValueError, match="unknown image uuid 'dog'"):
        cproc.process_chat(chat(image_part(None, "dog")))
    with pytest.raises(ValueError, match="uuid must be a string"):
        cproc.process_chat(chat({"type": "image_url", "image_url": {}, "uuid": 7}))
    with pytest.raises(ValueError, match="needs its data"):
        cproc.process_chat(chat({"type": "image_url", "image_url": {}}))


def test_uuid_reused_for_other_content_is_refused_when_pixels_are_needed(cproc):
    cproc.process_chat(chat(image_part(data_url(img(6, 56, 56)), uuid="u")))
    p = cproc.process_chat(chat(image_part(data_url(img(7, 112, 112)), uuid="u")))
    (it,) = p.mm_items
    assert it.grid_thw == (1, 4, 4)  # the uuid's first content, as promised by the client
    with pytest.raises(ValueError, match="differs"):
        cproc.load_pixels(it, p.mm_sources[0])
    with pytest.raises(ValueError, match="unknown image uuid"):  # forgotten after that
        cproc.process_chat(chat(image_part(None, "u")))


def test_without_a_cache_everything_is_processed(tiny_qwen2_vl, tmp_path):
    p = make(tiny_qwen2_vl, tmp_path, None)
    url = data_url(img(8))
    p.process_chat(chat(image_part(url, uuid="x")))
    (it,) = p.process_chat(chat(image_part(url, uuid="x"))).mm_items
    assert p.contract.calls == 2 and it.pixel_values is not None
    with pytest.raises(ValueError, match="unknown image uuid"):
        p.process_chat(chat(image_part(None, "x")))
    assert p.stats()["mm_processor_cache_hits"] == 0


def test_processor_settings_change_keys(tiny_qwen2_vl, tmp_path):
    other_dir = tmp_path / "other"
    shutil.copytree(tiny_qwen2_vl, other_dir)
    cfg_path = other_dir / "preprocessor_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["image_mean"] = [0.5, 0.5, 0.5]
    cfg_path.write_text(json.dumps(cfg))
    shared = ProcessorCacheIndex(64 << 20)  # even one index cannot mix them up
    a, b = make(tiny_qwen2_vl, tmp_path, shared), make(str(other_dir), tmp_path, shared)
    url = data_url(img(9))
    x = a.process_chat(chat(image_part(url))).mm_items[0]
    y = b.process_chat(chat(image_part(url))).mm_items[0]
    assert x.mm_hash != y.mm_hash and y.pixel_values is not None
    assert not torch.equal(x.pixel_values, y.pixel_values)
    ux = a.process_chat(chat(image_part(url, uuid="same"))).mm_items[0]
    uy = b.process_chat(chat(image_part(url, uuid="same"))).mm_items[0]
    assert ux.mm_hash != uy.mm_hash and uy.pixel_values is not None


def test_offline_prompts_take_multi_modal_uuids(cproc):
    text = "<|vision_start|><|image_pad|><|vision_end|>Describe."
    im = img(10)
    first = cproc.process_prompt({"prompt": text, "multi_modal_data": {"image": [im]},
                                  "multi_modal_uuids": {"image": ["photo"]}})
    again = cproc.process_prompt({"prompt": text, "multi_modal_data": {"image": [None]},
                                  "multi_modal_uuids": {"image": ["photo"]}})
    assert again.prompt_token_ids == first.prompt_token_ids
    assert again.mm_items[0].mm_hash == first.mm_items[0].mm_hash
    assert cproc.contract.calls == 1
    with pytest.raises(ValueError, match="1 image"):
        cproc.process_prompt({"prompt": text, "multi_modal_data": {"image": [im]},
                              "multi_modal_uuids": {"image": ["a", "b"]}})
    with pytest.raises(ValueError, match="unknown image uuid"):
        cproc.process_prompt({"prompt": text, "multi_modal_data": {"image": [None]},
                              "multi_modal_uuids": {"image": ["never-seen"]}})
