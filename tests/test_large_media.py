"""Large media (issue 15, point 4): a tensor over one frame's cap travels in several frames,
so a 12 MP photo's fp32 pixels (~288 MB, over the 256 MiB frame cap) reach the worker; a
forged or truncated set of frames is refused."""
from __future__ import annotations

import io
import json
import os
import shutil
import signal
import sys

import httpx
import numpy as np
import pytest
import torch
from PIL import Image
from triptych.worker import wire

sys.path.insert(0, os.path.dirname(__file__))
from server_fixtures import ServerProc, data_url, image_part, text_part, user


def test_a_tensor_over_the_frame_cap_travels_in_several_frames(monkeypatch):
    monkeypatch.setattr(wire, "MAX_FRAME_BYTES", 100)
    t = torch.arange(70, dtype=torch.float32).view(7, 10)  # 280 bytes: 3 frames
    meta = wire.tensor_meta(t)
    frames = wire.encode_tensors([t])
    assert [len(f) for f in frames] == [100, 100, 80] and wire.frames_of(meta) == 3
    assert torch.equal(wire.tensor_from_frames(meta, frames), t)
    small = torch.ones(2, 3)  # one frame, as before
    assert wire.encode_tensors([small, torch.empty(0, 4)]) == \
        [small.numpy().tobytes(), b""]
    with pytest.raises(ValueError):
        wire.tensor_from_frames(meta, frames[:2])  # a frame missing
    with pytest.raises(ValueError):
        wire.tensor_from_frames(meta, [frames[0], frames[1], frames[2] + b"x"])
    with pytest.raises(ValueError):
        wire.frames_of(wire.TensorMeta("float32", [1 << 40]))  # a forged shape


def test_the_worker_reads_an_item_spread_over_frames(monkeypatch):
    from triptych.mmcache.consumer import WorkerPixels

    monkeypatch.setattr(wire, "MAX_FRAME_BYTES", 64)
    a, b = torch.randn(5, 8), torch.randn(2, 3)  # 160 bytes (3 frames), 24 bytes (1 frame)
    items = [wire.WireMMItem("image", h, 0, 1, [1, 2, 2], wire.tensor_meta(t))
             for h, t in (("a", a), ("b", b))]
    frames = [b"header"] + wire.encode_tensors([a, b])
    got = WorkerPixels("", 0).items(items, frames, [])
    assert torch.equal(got[0].pixel_values, a) and torch.equal(got[1].pixel_values, b)
    with pytest.raises(ValueError):
        WorkerPixels("", 0).items(items, frames[:-1], [])


@pytest.fixture(scope="module")
def big_image_model(tiny_qwen2_vl, tmp_path_factory) -> str:
    """The tiny checkpoint whose image processor keeps photos up to Qwen2-VL's own cap
    (12.8 MP) instead of the tiny default (0.2 MP)."""
    d = str(tmp_path_factory.mktemp("big") / "qwen2_vl")
    shutil.copytree(tiny_qwen2_vl, d)
    path = os.path.join(d, "preprocessor_config.json")
    with open(path) as f:
        cfg = json.load(f)
    cfg["max_pixels"] = 12845056
    cfg.setdefault("size", {})["longest_edge"] = 12845056
    with open(path, "w") as f:
        json.dump(cfg, f)
    return d


def test_a_12_megapixel_photo_is_served(big_image_model, tmp_path):
    w, h = 4032, 3024  # a phone's 12 MP photo; pixels: ~288 MB of fp32 after the processor
    x = np.linspace(0, 255, w, dtype=np.float32)
    arr = np.stack([np.broadcast_to(x, (h, w)), np.broadcast_to(x[::-1], (h, w)),
                    np.full((h, w), 90, np.float32)], axis=-1).astype(np.uint8)
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="JPEG", quality=80)
    s = ServerProc(big_image_model, tmp_path / "serve.log", "--max-model-len", "32768",
                   "--max-num-batched-tokens", "8192", "--served-model-name", "tiny",
                   "--mm-processor-cache-gb", "0")
    try:
        r = httpx.post(s.base + "/v1/chat/completions", timeout=900,  # a hang guard
                       json={"model": "tiny", "max_tokens": 2, "messages": user(
                           image_part(data_url(buf.getvalue(), "image/jpeg")),
                           text_part("Describe."))})
        assert r.status_code == 200, r.text
        usage = r.json()["usage"]
        # 12 MP in 28x28 merged patches: some 15 000 image tokens, so the full photo went
        assert usage["prompt_tokens"] > 14_000 and usage["completion_tokens"] == 2
    finally:
        s.stop(signal.SIGTERM, timeout=60)
        s.cleanup_descendants()


def test_an_image_over_the_context_names_the_flag(tiny_qwen2_vl):
    from triptych.api.processor import InputProcessor

    proc = InputProcessor(tiny_qwen2_vl, max_model_len=64)
    im = Image.fromarray(np.zeros((448, 448, 3), np.uint8))  # 256 image tokens
    with pytest.raises(ValueError, match=r"maximum context length is 64 .*--max-model-len"):
        proc.process_chat([{"role": "user", "content": [{"type": "image", "image": im},
                                                         {"type": "text", "text": "hi"}]}])
