"""Multimodal content hashes: the key of every cache that holds image or video data.

A key covers what the processor sees (mode, size, dtype/shape, the pixel bytes) and every
processor kwarg that changes its output. Hashing only the pixel bytes made a 30x100 and a
100x30 image with the same bytes collide (CVE-2025-46722).

Encoding: a domain tag, then each field length-prefixed, so no two different inputs share
a byte stream; kwargs as sorted, compact JSON (only JSON types: a repr could hold a memory
address and differ between processes). blake2b-256, hex.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np
from PIL import Image


def _field(h: Any, data: bytes) -> None:
    h.update(len(data).to_bytes(8, "little"))
    h.update(data)


def _kwargs_bytes(kwargs: dict[str, Any]) -> bytes:
    try:
        return json.dumps(kwargs, sort_keys=True, separators=(",", ":"),
                          allow_nan=False).encode()
    except (TypeError, ValueError) as e:
        raise TypeError(f"processor kwargs must be plain JSON values to be hashed: {e}") from None


def hash_image(img: Image.Image, processor_kwargs: dict[str, Any]) -> str:
    """Content hash of a decoded image under the processor settings that will see it."""
    h = hashlib.blake2b(digest_size=32)
    _field(h, b"triptych.image.v1")
    _field(h, f"{img.mode}|{img.width}x{img.height}".encode())
    _field(h, _kwargs_bytes(processor_kwargs))
    _field(h, img.tobytes())
    return h.hexdigest()


def hash_video(frames: np.ndarray, processor_kwargs: dict[str, Any], fps: float) -> str:
    """``frames``: [T, H, W, 3] uint8 after sampling; ``fps`` the rate they were sampled at
    (it sets second_per_grid_t, so it changes Qwen2.5-VL's positions)."""
    frames = np.ascontiguousarray(frames)
    h = hashlib.blake2b(digest_size=32)
    _field(h, b"triptych.video.v1")
    _field(h, f"{frames.dtype.str}|{'x'.join(map(str, frames.shape))}|{float(fps)!r}".encode())
    _field(h, _kwargs_bytes(processor_kwargs))
    _field(h, frames.tobytes())
    return h.hexdigest()
