"""Multimodal content hashes: the key of every cache that holds image or video data.

A key covers what the processor sees (mode, size, dtype/shape, the pixel bytes) and every
processor kwarg that changes its output. Hashing only the pixel bytes made a 30x100 and a
100x30 image with the same bytes collide (CVE-2025-46722).
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np
from PIL import Image


def _kwargs_bytes(kwargs: dict[str, Any]) -> bytes:
    return json.dumps(kwargs, sort_keys=True, default=str).encode()


def hash_image(img: Image.Image, processor_kwargs: dict[str, Any]) -> str:
    h = hashlib.blake2b(digest_size=32)
    h.update(b"image\0")
    h.update(f"{img.mode}\0{img.width}x{img.height}\0".encode())
    h.update(_kwargs_bytes(processor_kwargs))
    h.update(img.tobytes())
    return h.hexdigest()


def hash_video(frames: np.ndarray, processor_kwargs: dict[str, Any], fps: float) -> str:
    """``frames``: [T, H, W, 3] uint8 after sampling."""
    h = hashlib.blake2b(digest_size=32)
    h.update(b"video\0")
    h.update(f"{frames.dtype}\0{frames.shape}\0{fps:.6f}\0".encode())
    h.update(_kwargs_bytes(processor_kwargs))
    h.update(np.ascontiguousarray(frames).tobytes())
    return h.hexdigest()
