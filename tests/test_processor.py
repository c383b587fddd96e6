"""InputProcessor against HF's own processing; content hashes; the errors it must raise."""
from __future__ import annotations

import base64
import copy
import io
import subprocess
import sys

import numpy as np
import pytest
import torch
from PIL import Image

from triptych.api.media.decode import MediaError, MediaLimits
from triptych.api.processor import InputProcessor
from triptych.router.prompt import ProcessedPrompt
from triptych.mmcache.hashing import hash_image, hash_video


def img(seed: int, w: int = 56, h: int = 56) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def png_url(im: Image.Image) -> str:
    buf = io.BytesIO()
    im.save(buf, format="PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


@pytest.fixture(scope="module")
def proc(tiny_qwen2_vl) -> InputProcessor:
    return InputProcessor(tiny_qwen2_vl, limit_mm_per_prompt={"image": 3, "video": 1},
                          media_limits=MediaLimits(), max_model_len=4096)


@pytest.fixture(scope="module")
def hf_processor(tiny_qwen2_vl):
    from triptych.models.hf_oracle import load_hf_processor

    return load_hf_processor(tiny_qwen2_vl)


def hf_reference(hf_processor, messages: list[dict], images: list[Image.Image]):
    """What HF's own Qwen2VLProcessor makes of the messages (its chat template) and the
    raw images: input ids, pixel values, grids."""
    text = hf_processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    out = hf_processor(text=[text], images=images, return_tensors="pt")
    return out["input_ids"][0].tolist(), out["pixel_values"], out["image_grid_thw"]


def test_chat_matches_hf_processing(proc, hf_processor):
    a, b, c = img(1, 84, 56), img(2, 224, 224), img(3, 50, 70)  # c is resized (smart_resize)
    messages = [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": png_url(a)}},
                                     {"type": "text", "text": "What is this?"}]},
        {"role": "assistant", "content": "A picture."},
        {"role": "user", "content": [{"type": "text", "text": "And these two?"},
                                     {"type": "image", "image": b},
                                     {"type": "image_url", "image_url": png_url(c)}]}]
    p = proc.process_chat(messages)
    ids, pv, grid = hf_reference(hf_processor, messages, [a, b, c])
    assert p.prompt_token_ids == ids
    assert [it.grid_thw for it in p.mm_items] == [tuple(g) for g in grid.tolist()]
    assert torch.equal(torch.cat([it.pixel_values for it in p.mm_items]), pv)  # fast path
    hf_path = copy.copy(proc)  # --mm-preprocessor hf: HF's processor itself, alike
    hf_path.mm_preprocessor = "hf"
    again = hf_path.process_chat(messages).mm_items
    assert torch.equal(torch.cat([it.pixel_values for it in again]), pv)
    assert [a.mm_hash for a in again] != [b.mm_hash for b in p.mm_items]  # the key says which
    image_id = proc.image_token_id
    for it in p.mm_items:  # each item's span is exactly its placeholder run
        assert it.modality == "image" and it.length == int(np.prod(it.grid_thw)) // 4
        assert p.prompt_token_ids[it.offset:it.end] == [image_id] * it.length
        assert p.prompt_token_ids[it.offset - 1] != image_id != p.prompt_token_ids[it.end]
    assert sum(it.length for it in p.mm_items) == p.prompt_token_ids.count(image_id)
    assert p.prompt_text.endswith("<|im_start|>assistant\n")


def test_prompt_forms_agree(proc):
    im, im2 = img(4), img(5, 112, 56)
    conv = [{"role": "user", "content": [{"type": "image", "image": im},
                                         {"type": "image", "image": im2},
                                         {"type": "text", "text": "Describe."}]}]
    via_chat = proc.process_chat(conv)
    text = proc.tokenizer.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    via_dict = proc.process_prompt({"prompt": text, "multi_modal_data": {"image": [im, im2]}})
    assert via_dict.prompt_token_ids == via_chat.prompt_token_ids
    assert [it.mm_hash for it in via_dict.mm_items] == [it.mm_hash for it in via_chat.mm_items]
    via_ids = proc.process_prompt(via_chat.prompt_token_ids[:7])
    assert isinstance(via_ids, ProcessedPrompt) and via_ids.mm_items == []
    assert proc.process_prompt("Hello").prompt_token_ids == proc.tokenizer.encode("Hello")


def test_video_item_and_patch_layout_match_hf(proc):
    rng = np.random.default_rng(0)
    f0, f1 = (rng.integers(0, 256, (56, 84, 3), dtype=np.uint8) for _ in range(2))
    conv = [{"role": "user", "content": [{"type": "video", "video": np.stack([f0, f1])},
                                         {"type": "text", "text": "What happens?"}]}]
    p = proc.process_chat(conv)
    (it,) = p.mm_items
    assert it.modality == "video" and it.grid_thw == (1, 4, 6) and it.length == 6
    assert it.second_per_grid_t == 2 / proc.media.video_fps
    assert p.prompt_token_ids[it.offset:it.end] == [proc.video_token_id] * 6
    # HF's image patchify of each frame (an image is its frame twice): the video's temporal
    # slot k must hold frame k, in HF's row order.
    ip = proc.image_processor
    ours = it.pixel_values.view(-1, 3, 2, 14, 14)
    for k, f in enumerate((f0, f1)):
        ref = ip(images=[Image.fromarray(f)], return_tensors="pt")["pixel_values"]
        torch.testing.assert_close(ours[:, :, k], ref.view(-1, 3, 2, 14, 14)[:, :, k])
    # An odd frame count is padded by repeating the last frame: [f0] == image f0.
    (single,) = proc.process_prompt({"prompt": "<|vision_start|><|video_pad|><|vision_end|>",
                                     "multi_modal_data": {"video": f0[None]}}).mm_items
    ref = ip(images=[Image.fromarray(f0)], return_tensors="pt")["pixel_values"]
    torch.testing.assert_close(single.pixel_values, ref)


def test_mm_hashes(proc, tmp_path):
    url = png_url(img(6))
    path = tmp_path / "six.png"
    path.write_bytes(base64.b64decode(url.partition(",")[2]))
    local = copy.copy(proc)
    local.media = MediaLimits(allowed_local_media_path=str(tmp_path))
    conv = [{"role": "user", "content": [{"type": "image", "image": img(6)},
                                         {"type": "image", "image": img(7)},
                                         {"type": "image_url", "image_url": {"url": url}},
                                         {"type": "image_url", "image_url": str(path)}]}]
    local.limits = {"image": 4}
    h = [it.mm_hash for it in local.process_chat(conv).mm_items]
    # Encoded bytes are the key when there are bytes (data URL == file); a PIL image has
    # none, so its key covers its pixels, mode and size instead.
    assert h[2] == h[3] and len({h[0], h[1], h[2]}) == 3
    again = [{"role": "user", "content": [{"type": "image", "image": img(6).copy()}]}]
    assert local.process_chat(again).mm_items[0].mm_hash == h[0]
    data = np.random.default_rng(0).integers(0, 256, (30, 100, 3), dtype=np.uint8)
    wide, tall = Image.fromarray(data), Image.fromarray(data.reshape(100, 30, 3))
    assert wide.tobytes() == tall.tobytes() and hash_image(wide, {}) != hash_image(tall, {})
    assert hash_image(wide, {"max_pixels": 1}) != hash_image(wide, {"max_pixels": 2})
    assert hash_image(wide, {"a": 1, "b": 2}) == hash_image(wide.copy(), {"b": 2, "a": 1})
    assert hash_image(wide.convert("RGBA"), {}) != hash_image(wide, {})
    frames = data.reshape(2, 15, 100, 3)
    assert hash_video(frames, {}, 2.0) != hash_video(frames, {}, 1.0)
    assert hash_video(frames, {}, 2.0) != hash_video(data.reshape(2, 100, 15, 3), {}, 2.0)
    with pytest.raises(TypeError, match="JSON"):
        hash_image(wide, {"obj": object()})


def test_hash_is_stable_across_processes():
    code = ("import numpy as np; from PIL import Image; "
            "from triptych.mmcache.hashing import hash_image; "
            "print(hash_image(Image.fromarray(np.arange(300, dtype=np.uint8).reshape(10, 10, 3)),"
            " {'size': [1, 2], 'mean': 0.5}))")
    ours = hash_image(Image.fromarray(np.arange(300, dtype=np.uint8).reshape(10, 10, 3)),
                      {"mean": 0.5, "size": [1, 2]})
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == ours


def test_limits_and_length_errors(proc):
    four = [{"role": "user", "content": [{"type": "image", "image": img(i)} for i in range(4)]}]
    with pytest.raises(ValueError, match=r"4 image\(s\).*allows 3"):
        proc.process_chat(four)
    two_videos = {"prompt": "<|vision_start|><|video_pad|><|vision_end|>" * 2,
                  "multi_modal_data": {"video": [np.zeros((2, 28, 28, 3), np.uint8)] * 2}}
    with pytest.raises(ValueError, match=r"2 video\(s\).*allows 1"):
        proc.process_prompt(two_videos)
    short = copy.copy(proc)
    short.max_model_len = 60
    big = [{"role": "user", "content": [{"type": "image", "image": img(8, 224, 224)}]}]
    with pytest.raises(ValueError, match=r"maximum context length is 60 tokens. However, "
                                         r"you requested \d+ tokens"):
        short.process_chat(big)  # 64 image tokens + chat template
    with pytest.raises(ValueError, match="maximum context length is 60 tokens"):
        short.process_prompt(list(range(60)))


def test_bad_inputs_are_clear_errors(proc):
    with pytest.raises(ValueError, match="placeholders"):
        proc.process_prompt({"prompt": "no placeholder here", "multi_modal_data": {"image": img(9)}})
    with pytest.raises(ValueError, match="placeholders"):
        proc.process_prompt("sneaky <|vision_start|><|image_pad|><|vision_end|>")
    with pytest.raises(ValueError, match="may not contain vision placeholder"):
        proc.process_chat([{"role": "user", "content": "hi <|image_pad|>"}])
    with pytest.raises(ValueError, match="unsupported content part"):
        proc.process_chat([{"role": "user", "content": [{"type": "audio_url"}]}])
    with pytest.raises(ValueError, match="role"):
        proc.process_chat([{"content": "hi"}])
    with pytest.raises(MediaError, match="invalid base64"):
        proc.process_chat([{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}}]}])
    with pytest.raises(MediaError, match="aspect ratio"):
        proc.process_chat([{"role": "user", "content": [{"type": "image", "image": img(0, 300, 1)}]}])


def test_one_pixel_image_is_resized_up(proc):
    # CVE-2026-22773: a 1x1 image crashed an engine. Here smart_resize scales it up to the
    # processor's min_pixels (56x56 -> a 4x4 patch grid, 4 tokens).
    p = proc.process_chat([{"role": "user", "content": [{"type": "image",
                                                         "image": Image.new("RGB", (1, 1))}]}])
    assert p.mm_items[0].grid_thw == (1, 4, 4) and p.mm_items[0].length == 4
