"""Qwen2-VL video preprocessing, done here because HF's video processor needs torchvision.

frames [T, H, W, 3] uint8 -> pixel_values [grid_t*grid_h*grid_w, C*tps*ps*ps], grid (t, h, w):
each frame is resized to a multiple of patch*merge (smart_resize within the pixel budget),
rescaled and normalised like an image; T is padded to a multiple of temporal_patch_size by
repeating the last frame; patches are laid out in HF's order
(t, h/m, w/m, m_h, m_w, C, tps, p_h, p_w), the same as its image patchify.
"""
from __future__ import annotations

from typing import Any

import numpy as np
from PIL import Image


def preprocess_video(frames: np.ndarray, image_processor: Any, *, min_pixels: int,
                     max_pixels: int) -> tuple[np.ndarray, tuple[int, int, int]]:
    from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

    ps, m, tps = (image_processor.patch_size, image_processor.merge_size,
                  image_processor.temporal_patch_size)
    t, h, w, _ = frames.shape
    rh, rw = smart_resize(h, w, factor=ps * m, min_pixels=min_pixels, max_pixels=max_pixels)
    mean = np.asarray(image_processor.image_mean, dtype=np.float32)[:, None, None]
    std = np.asarray(image_processor.image_std, dtype=np.float32)[:, None, None]
    out = []
    for f in frames:  # [H, W, 3] -> [3, rh, rw] float32, normalised
        img = Image.fromarray(f).resize((rw, rh), Image.BICUBIC)
        x = np.asarray(img, dtype=np.float32).transpose(2, 0, 1) * image_processor.rescale_factor
        out.append((x - mean) / std)
    video = np.stack(out)  # [T, C, rh, rw]
    if t % tps:
        video = np.concatenate([video, np.repeat(video[-1:], tps - t % tps, axis=0)])
    gt, gh, gw = video.shape[0] // tps, rh // ps, rw // ps
    c = video.shape[1]
    x = video.reshape(gt, tps, c, gh // m, m, ps, gw // m, m, ps)
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)  # (gt, gh/m, gw/m, m, m, C, tps, ps, ps)
    return np.ascontiguousarray(x.reshape(gt * gh * gw, c * tps * ps * ps)), (gt, gh, gw)
