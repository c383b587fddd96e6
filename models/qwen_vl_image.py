"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL images, the fast way: HF's Qwen2VLImageProcessor's
``pixel_values`` and grid from models/image_ops.py's primitives.

HF's steps, and ours:

    HF (PIL backend)                                ours
    smart_resize(h, w, patch * merge, size)         the same arithmetic (image_ops)
    PIL resize, bicubic                             Pillow's passes, vectorised (same bytes)
    rescale (float64) -> normalise (float32)        one table lookup per sample ...
    reshape + transpose into merge-grouped patches  ... read through a view in patch order
    temporal_patch_size copies of the one frame     ... written once per temporal slot

The patch order is HF's: (grid row / merge, grid col / merge, merge row, merge col) over the
rows, (channel, temporal, patch row, patch col) over the columns; a still image fills every
temporal slot with itself. The size settings are the processor's ``size`` (shortest_edge =
min_pixels, longest_edge = max_pixels: HF folds a checkpoint's top-level min_pixels /
max_pixels into it when it loads the file). ``do_convert_rgb`` has nothing left to do: images
arrive as 8-bit RGB (api/media/pixels.py).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
from triptych.models import image_ops

MAX_ASPECT_RATIO = 200  # HF's smart_resize refuses more


def unsupported(ip: Any) -> str | None:
    """Why the fast path cannot stand in for this image processor (None: it can)."""
    size = dict(ip.size or {})
    if not {"shortest_edge", "longest_edge"} <= size.keys():
        return f"its size {size} has no shortest_edge / longest_edge"
    if not ip.do_resize:
        return "do_resize is off"
    if not image_ops.supports_resample(ip.resample):
        return f"resample {int(ip.resample)} is neither bicubic nor bilinear"
    return None


def _target(ip: Any, h: int, w: int) -> tuple[int, int]:
    if max(h, w) > MAX_ASPECT_RATIO * min(h, w):
        raise ValueError(f"absolute aspect ratio must be smaller than {MAX_ASPECT_RATIO}, "
                         f"got {max(h, w) / min(h, w)}")
    size = dict(ip.size)
    return image_ops.smart_resize(h, w, ip.patch_size * ip.merge_size, size["shortest_edge"],
                                  size["longest_edge"])


def pixel_shape(ip: Any, h: int, w: int) -> tuple[int, int]:
    """The [rows, columns] of an ``h`` x ``w`` image's pixel_values (before processing)."""
    height, width = _target(ip, h, w)
    p = ip.patch_size
    return (height // p) * (width // p), 3 * ip.temporal_patch_size * p * p


def preprocess(ip: Any, rgb: np.ndarray, out: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """[H, W, 3] uint8 -> (pixel_values [t*h*w, 3 * tps * patch**2] float32, (1, h, w)),
    written into ``out`` when given (``image_ops.output``)."""
    h, w = rgb.shape[:2]
    p, m, tps = ip.patch_size, ip.merge_size, ip.temporal_patch_size
    height, width = _target(ip, h, w)
    img = image_ops.resize_u8(image_ops.as_tensor(rgb), height, width, ip.resample)
    gh, gw = height // p, width // p
    # [H, W, 3] -> (gh/m, gw/m, m, m, 3, p, p): HF's order, still a view of the uint8 image
    patches = img.unflatten(0, (gh // m, m, p)).unflatten(3, (gw // m, m, p)) \
        .permute(0, 3, 1, 4, 6, 2, 5)
    out = image_ops.output(out, (gh * gw, 3 * tps * p * p))
    # every temporal slot holds the image: written from the one lookup of each sample
    image_ops.table_lookup(patches.unsqueeze(5), image_ops.value_table(ip), 4,
                           out.view(*patches.shape[:5], tps, p, p))
    return out, (1, gh, gw)


__all__ = ["pixel_shape", "preprocess", "unsupported"]
