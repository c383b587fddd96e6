"""Multimodal keys: what must and must not share a key (mmcache/hashing.py)."""
from __future__ import annotations

import base64
import io
import subprocess
import sys

import numpy as np
import pytest
from PIL import Image

from triptych.api.media.decode import MediaLimits, read_media_bytes
from triptych.mmcache.hashing import hash_image, hash_media_bytes, hash_uuid, hash_video

KW = {"patch": 14, "merge": 2, "size": {"shortest_edge": 3136, "longest_edge": 200704}}


def png(arr: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(arr).save(buf, format="PNG")
    return buf.getvalue()


def test_kwargs_change_every_kind_of_key():
    data = png(np.zeros((8, 8, 3), np.uint8))
    other = {**KW, "size": {"shortest_edge": 3136, "longest_edge": 100352}}
    assert hash_media_bytes("image", data, KW) != hash_media_bytes("image", data, other)
    assert hash_uuid("image", "u1", KW) != hash_uuid("image", "u1", other)
    im = Image.open(io.BytesIO(data))
    assert hash_image(im, KW) != hash_image(im, other)
    # Key order of the kwargs is not a difference; their values are.
    assert hash_media_bytes("image", data, {"b": 1, "a": 2}) == \
        hash_media_bytes("image", data, {"a": 2, "b": 1})


def test_modality_and_domain_separate_keys():
    data = b"same bytes"
    assert hash_media_bytes("image", data, KW) != hash_media_bytes("video", data, KW)
    assert hash_uuid("image", "abc", KW) != hash_uuid("video", "abc", KW)
    # A uuid never collides with content that spells the same bytes.
    assert hash_uuid("image", "abc", KW) != hash_media_bytes("image", b"abc", KW)
    with pytest.raises(ValueError, match="modality"):
        hash_media_bytes("audio", data, KW)
    for bad in ("", "x" * 257, 5):
        with pytest.raises(ValueError, match="uuid"):
            hash_uuid("image", bad, KW)  # type: ignore[arg-type]


def test_data_url_and_file_give_the_same_key(tmp_path):
    data = png(np.random.default_rng(0).integers(0, 256, (20, 30, 3), dtype=np.uint8))
    path = tmp_path / "im.png"
    path.write_bytes(data)
    limits = MediaLimits(allowed_local_media_path=str(tmp_path))
    url = "data:image/png;base64," + base64.b64encode(data).decode()
    keys = {hash_media_bytes("image", read_media_bytes(src, limits, 1 << 20), KW)
            for src in (url, str(path), f"file://{path}")}
    assert len(keys) == 1


def test_identical_pixel_buffers_with_other_shapes_never_share():
    data = np.random.default_rng(1).integers(0, 256, (30, 100, 3), dtype=np.uint8)
    wide, tall = Image.fromarray(data), Image.fromarray(data.reshape(100, 30, 3))
    assert wide.tobytes() == tall.tobytes()
    assert hash_image(wide, KW) != hash_image(tall, KW)
    assert hash_media_bytes("image", png(data), KW) != \
        hash_media_bytes("image", png(data.reshape(100, 30, 3)), KW)
    frames = data.reshape(2, 15, 100, 3)
    assert hash_video(frames, KW, 2.0) != hash_video(data.reshape(2, 100, 15, 3), KW, 2.0)
    assert hash_video(frames, KW, 2.0) != hash_video(frames, KW, 1.0)  # fps moves positions
    assert hash_image(wide.convert("RGBA"), KW) != hash_image(wide, KW)


def test_different_images_never_share():
    rng = np.random.default_rng(2)
    arrays = [rng.integers(0, 256, (16, 16, 3), dtype=np.uint8) for _ in range(200)]
    arrays.append(arrays[0].copy())
    arrays[-1][0, 0, 0] ^= 1  # one bit apart
    assert len({hash_media_bytes("image", png(a), KW) for a in arrays}) == len(arrays)
    assert len({hash_image(Image.fromarray(a), KW) for a in arrays}) == len(arrays)


def test_byte_keys_are_stable_across_processes():
    code = ("from triptych.mmcache.hashing import hash_media_bytes, hash_uuid; "
            "print(hash_media_bytes('image', b'abc', {'x': [1, 2]}), hash_uuid('video', 'u', {}))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True, timeout=60)
    assert out.stdout.split() == [hash_media_bytes("image", b"abc", {"x": [1, 2]}),
                                  hash_uuid("video", "u", {})]
