"""Multimodal content keys: the key of every cache that holds image or video data.

A key is computed *before* anything is decoded or run through the HF processor, so a
repeated image costs a hash at most. Three kinds, each behind its own domain tag:

- ``hash_media_bytes``: the encoded bytes a client sent (data URL payload, file bytes,
  downloaded bytes). The same file as a data URL or as a path gives the same key.
- ``hash_pixels`` / ``hash_image`` / ``hash_video``: decoded pixels, for inputs that have
  no bytes (a PIL image, made 8-bit RGB once, or a frame array given to the offline API).
  They cover mode, size, dtype and shape: hashing only the pixel bytes made a 30x100 and a
  100x30 image collide (CVE-2025-46722). Arrays are hashed in place (no copy).
- ``hash_uuid``: a client-chosen ``uuid`` of a content part; the client promises that one
  uuid always names the same content (vLLM's semantics). A uuid is a name, not content, so
  its key also covers the *scope* it was named in (the tenant and the request's
  ``cache_salt``): one tenant's uuid never finds, nor plants, another tenant's pixels.

``media_key`` picks among them: it is the one place that decides an item's key, so every
cache (P0's processor-cache index, worker pixel stores, the shm ring, encoder caches, the
prefix-block hashes that carry mm keys) agrees on what an item is.

Every key also covers the modality and every processor kwarg that changes the processed
result. Encoding: a domain tag, then each field length-prefixed, so no two different inputs
share a byte stream; kwargs as sorted, compact JSON (only JSON types: a repr could hold a
memory address and differ between processes). blake2b-256, hex.
"""
from __future__ import annotations

import hashlib
import json
from typing import Any

import numpy as np
from PIL import Image

MODALITIES = ("image", "video")
MAX_UUID_LEN = 256  # a uuid is a label, not a payload


def _field(h: Any, data: Any) -> None:
    """``data``: bytes, or any C-contiguous buffer (an ndarray is hashed in place, never
    copied)."""
    view = memoryview(data).cast("B")
    h.update(view.nbytes.to_bytes(8, "little"))
    h.update(view)


def _kwargs_bytes(kwargs: dict[str, Any]) -> bytes:
    try:
        return json.dumps(kwargs, sort_keys=True, separators=(",", ":"),
                          allow_nan=False).encode()
    except (TypeError, ValueError) as e:
        raise TypeError(f"processor kwargs must be plain JSON values to be hashed: {e}") from None


def _check_modality(modality: str) -> None:
    if modality not in MODALITIES:
        raise ValueError(f"unknown modality {modality!r}")


def hash_media_bytes(modality: str, data: bytes, processor_kwargs: dict[str, Any]) -> str:
    """Key of encoded media bytes (an image or video file as sent), before decoding.

    ``processor_kwargs`` must hold everything that turns these bytes into pixel values:
    the image processor's settings and, for videos, the sampling settings (fps, frame cap).
    """
    _check_modality(modality)
    h = hashlib.blake2b(digest_size=32)
    _field(h, b"triptych.media-bytes.v1")
    _field(h, modality.encode())
    _field(h, _kwargs_bytes(processor_kwargs))
    _field(h, data)
    return h.hexdigest()


def hash_uuid(modality: str, uuid: str, processor_kwargs: dict[str, Any], scope: str = ""
              ) -> str:
    """Key of a client-named item: the uuid, scoped to the modality, the processor kwargs
    (the same uuid under other processor settings is other pixel values) and the naming
    ``scope`` (tenant + cache_salt; "" when the server has neither)."""
    _check_modality(modality)
    if not isinstance(uuid, str) or not uuid or len(uuid) > MAX_UUID_LEN:
        raise ValueError(f"a content part's uuid must be a non-empty string of at most "
                         f"{MAX_UUID_LEN} characters")
    h = hashlib.blake2b(digest_size=32)
    _field(h, b"triptych.uuid.v2")
    _field(h, scope.encode("utf-8", "surrogatepass"))
    _field(h, modality.encode())
    _field(h, _kwargs_bytes(processor_kwargs))
    _field(h, uuid.encode("utf-8", "surrogatepass"))
    return h.hexdigest()


def hash_image(img: Image.Image, processor_kwargs: dict[str, Any]) -> str:
    """Key of a decoded image (no encoded bytes available) under the processor settings."""
    h = hashlib.blake2b(digest_size=32)
    _field(h, b"triptych.image.v1")
    _field(h, f"{img.mode}|{img.width}x{img.height}".encode())
    _field(h, _kwargs_bytes(processor_kwargs))
    _field(h, img.tobytes())
    return h.hexdigest()


def hash_pixels(pixels: np.ndarray, processor_kwargs: dict[str, Any]) -> str:
    """Key of decoded 8-bit RGB pixels [H, W, 3] uint8 (a PIL image given to the offline
    API, made RGB once by api/media/pixels.py): dtype and shape, then the array's own
    buffer, read where it lies (a 1080p image costs the hash alone: no ``tobytes`` copy)."""
    pixels = np.ascontiguousarray(pixels)  # (a no-op for the arrays the api makes)
    h = hashlib.blake2b(digest_size=32)
    _field(h, b"triptych.pixels.v1")
    _field(h, f"{pixels.dtype.str}|{'x'.join(map(str, pixels.shape))}".encode())
    _field(h, _kwargs_bytes(processor_kwargs))
    _field(h, pixels)
    return h.hexdigest()


def hash_video(frames: np.ndarray, processor_kwargs: dict[str, Any], fps: float) -> str:
    """``frames``: [T, H, W, 3] uint8 after sampling; ``fps`` the rate they were sampled at
    (it sets second_per_grid_t, so it changes Qwen2.5-VL's positions)."""
    frames = np.ascontiguousarray(frames)
    h = hashlib.blake2b(digest_size=32)
    _field(h, b"triptych.video.v1")
    _field(h, f"{frames.dtype.str}|{'x'.join(map(str, frames.shape))}|{float(fps)!r}".encode())
    _field(h, _kwargs_bytes(processor_kwargs))
    _field(h, frames)
    return h.hexdigest()


def media_key(modality: str, processor_kwargs: dict[str, Any], *, uuid: str | None = None,
              payload: Any = None, scope: str = "") -> str:
    """The key of one media item: from its ``uuid`` when the client named it (scoped), else
    from ``payload`` (encoded bytes, a PIL image, or sampled ``(frames, fps)``).

    ``processor_kwargs`` must hold everything that changes the item's pixels, the
    request's effective video sampling caps included: whatever re-makes the pixels later
    (``InputProcessor.load_pixels``) must use exactly these settings. Content keys are not
    scoped: the server hashed the content itself, so a hit across tenants reveals nothing
    the other tenant did not already hold.
    """
    if uuid is not None:
        return hash_uuid(modality, uuid, processor_kwargs, scope)
    if isinstance(payload, bytes):
        return hash_media_bytes(modality, payload, processor_kwargs)
    if isinstance(payload, np.ndarray) and modality == "image":
        return hash_pixels(payload, processor_kwargs)
    if isinstance(payload, Image.Image):
        return hash_image(payload, processor_kwargs)
    if isinstance(payload, tuple) and len(payload) == 2:
        return hash_video(payload[0], processor_kwargs, payload[1])
    raise TypeError(f"cannot key a {modality} given as {type(payload).__name__}")
