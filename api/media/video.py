"""Video preprocessing, done here because HF's video processors need torchvision.

frames [T, H, W, 3] uint8 -> pixel_values [grid_t*grid_h*grid_w, C*tps*ps*ps], grid (t, h, w):
each frame is resized to a multiple of patch*merge (smart_resize within the pixel budget),
rescaled and normalised like an image; T is padded to a multiple of temporal_patch_size by
repeating the last frame; patches are laid out in HF's order
(t, h/m, w/m, m_h, m_w, C, tps, p_h, p_w), the same as its image patchify.

Two budgets, as HF's two video processors define them: Qwen2-VL's bounds the pixels of one
frame (``min_pixels`` / ``max_pixels``); Qwen3-VL's (``per_video=True``) bounds frames x
height x width of the whole clip (``size.shortest_edge`` / ``size.longest_edge``). A
Qwen3-VL checkpoint whose video_preprocessor_config.json sets ``cap_pixels_per_frame``
also caps each frame's share of that budget (``clip_budget``), as HF does then.

Qwen3-VL lays a video out as one span per temporal group, each after its timestamp
(``group_timestamps``; the processor splits the item with ``split_groups``).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
from PIL import Image
from triptych.engine.request import MMItem


def clip_budget(num_frames: int, min_pixels: int, max_pixels: int, cell: int,
                frame_cap_tokens: int | None) -> int:
    """Qwen3-VL's pixel budget of a clip of ``num_frames`` sampled frames. With
    ``cap_pixels_per_frame`` (``frame_cap_tokens`` = the config's ``max_video_tokens``)
    each frame may spend at most that many merge cells (``cell`` x ``cell`` pixels) and
    its even share of ``max_pixels``, but never less than 1.05 x ``min_pixels``; the clip's
    budget is that times the frames. Without it, ``max_pixels`` for the whole clip."""
    if not frame_cap_tokens:
        return max_pixels
    per_frame = min(frame_cap_tokens * cell * cell, max_pixels // num_frames)
    return max(per_frame, int(min_pixels * 1.05)) * num_frames


def preprocess_video(frames: np.ndarray, image_processor: Any, *, min_pixels: int,
                     max_pixels: int, per_video: bool = False,
                     frame_cap_tokens: int | None = None
                     ) -> tuple[np.ndarray, tuple[int, int, int]]:
    ps, m, tps = (image_processor.patch_size, image_processor.merge_size,
                  image_processor.temporal_patch_size)
    t, h, w, _ = frames.shape
    if per_video:
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize as sr3

        budget = clip_budget(t, min_pixels, max_pixels, ps * m, frame_cap_tokens)
        rh, rw = sr3(t, h, w, temporal_factor=tps, factor=ps * m, min_pixels=min_pixels,
                     max_pixels=budget)
    else:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import smart_resize

        rh, rw = smart_resize(h, w, factor=ps * m, min_pixels=min_pixels,
                              max_pixels=max_pixels)
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


def group_timestamps(grid_t: int, tps: int, second_per_grid_t: float | None,
                     num_frames: int | None = None) -> list[float]:
    """Seconds of each temporal group as Qwen3VLProcessor computes them: frame i of the
    sampled clip at ``i / fps``, the frame indices padded with the last one to a multiple
    of ``tps`` (as the frames are), and the mean of each group's first and last time."""
    fps = tps / (second_per_grid_t or tps / 24.0)  # HF's default when no rate is known: 24
    idx = list(range(num_frames or grid_t * tps))
    idx += [idx[-1]] * (-len(idx) % tps)
    secs = [i / fps for i in idx]
    return [(secs[g * tps] + secs[g * tps + tps - 1]) / 2 for g in range(grid_t)]


def group_key(key: str, g: int) -> str:
    """The content key of temporal group ``g`` of the video keyed ``key``."""
    return f"{key}#t{g}"


def split_groups(item: MMItem) -> list[MMItem]:
    """One video item -> one item per temporal group, grid (1, h, w), its rows of the pixels
    (None stays None: a processor-cache hit), keyed ``group_key``."""
    t, h, w = item.grid_thw
    rows = h * w
    return [MMItem("video", group_key(item.mm_hash, g), 0, 0, (1, h, w),
                   None if item.pixel_values is None
                   else item.pixel_values[g * rows:(g + 1) * rows],
                   item.second_per_grid_t) for g in range(t)]


def group_pixels(pixels: torch.Tensor, grid: tuple[int, int, int], g: int) -> torch.Tensor:
    rows = grid[1] * grid[2]
    return pixels[g * rows:(g + 1) * rows]
