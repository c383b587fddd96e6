"""InternVL images, the fast way: HF's GotOcr2ImageProcessor tiles from models/image_ops.py's
primitives, patchified as ``InternVLContract.preprocess_image`` hands them on.

HF's dynamic tiling (its processor always crops, see internvl_contract.CROP_TO_PATCHES):
among the grids of ``cols x rows`` tiles with min_patches <= cols * rows <= max_patches,
listed by tile count (then by cols, then rows), the one whose cols / rows is nearest the
image's width / height; on a tie the later grid wins while the image's area is above half
the grid's. The image is resized to the grid's canvas (tile * cols x tile * rows) and cut
row by row into tiles; when there is more than one tile, the whole image resized to one
tile follows as a thumbnail. ``max_patches`` 1 (or no crop) is one plain resize to ``size``.
Each tile is rescaled and normalised (one table lookup per sample) and cut into
``patch``-sized squares in row-major order, (channel, row, col) inside each.
"""
from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch
from triptych.models import image_ops


@functools.lru_cache(maxsize=256)
def tile_grid(height: int, width: int, tile_h: int, tile_w: int, min_tiles: int,
              max_tiles: int) -> tuple[int, int]:
    """(cols, rows) of HF's canvas for a ``width`` x ``height`` image."""
    grids = sorted(((c, r) for c in range(1, max_tiles + 1) for r in range(1, max_tiles + 1)
                    if min_tiles <= c * r <= max_tiles), key=lambda g: g[0] * g[1])
    aspect, area = width / height, width * height
    best, best_diff = (1, 1), float("inf")
    for cols, rows in grids:
        diff = abs(aspect - cols / rows)
        if diff < best_diff:
            best, best_diff = (cols, rows), diff
        elif diff == best_diff and area > 0.5 * tile_h * tile_w * cols * rows:
            best = (cols, rows)
    return best


def unsupported(ip: Any) -> str | None:
    """Why the fast path cannot stand in for this image processor (None: it can)."""
    size = dict(ip.size or {})
    if not {"height", "width"} <= size.keys() or size["height"] != size["width"]:
        return f"its tile size {size} is not square"
    if not image_ops.supports_resample(ip.resample):
        return f"resample {int(ip.resample)} is neither bicubic nor bilinear"
    if ip.max_patches <= 1 and not ip.do_resize:
        return "do_resize is off"
    return None


def _tiles(ip: Any, img: torch.Tensor, crop: bool) -> torch.Tensor:
    """[H, W, 3] uint8 -> [tiles, S, S, 3] uint8, HF's tiles in HF's order."""
    s = dict(ip.size)["height"]
    resample = ip.resample
    if not (crop and ip.max_patches > 1):
        if ip.do_resize:
            img = image_ops.resize_u8(img, s, s, resample)
        return img.unsqueeze(0)
    h, w = img.shape[:2]
    cols, rows = tile_grid(h, w, s, s, ip.min_patches, ip.max_patches)
    canvas = image_ops.resize_u8(img, s * rows, s * cols, resample)
    tiles = canvas.unflatten(0, (rows, s)).unflatten(2, (cols, s)).permute(0, 2, 1, 3, 4)
    if rows * cols == 1:
        return tiles.reshape(1, s, s, 3)
    # (a uint8 copy, tiles then thumbnail: a quarter of the floats' bytes)
    return torch.cat([tiles.reshape(rows * cols, s, s, 3),
                      image_ops.resize_u8(img, s, s, resample).unsqueeze(0)])


def pixel_shape(ip: Any, h: int, w: int, patch: int, crop: bool) -> tuple[int, int]:
    """The [rows, columns] of an ``h`` x ``w`` image's patches (before processing)."""
    s = dict(ip.size)["height"]
    n = 1
    if crop and ip.max_patches > 1:
        cols, rows = tile_grid(h, w, s, s, ip.min_patches, ip.max_patches)
        n = cols * rows + (cols * rows > 1)
    return n * (s // patch) ** 2, 3 * patch * patch


def preprocess(ip: Any, rgb: np.ndarray, patch: int, crop: bool,
               out: torch.Tensor | None = None) -> tuple[torch.Tensor, tuple[int, int, int]]:
    """[H, W, 3] uint8 -> (patches [tiles * g * g, 3 * patch**2] float32, (tiles, g, g)),
    written into ``out`` when given (``image_ops.output``)."""
    tiles = _tiles(ip, image_ops.as_tensor(rgb), crop)
    n, s = tiles.shape[0], tiles.shape[1]
    g = s // patch
    # [n, S, S, 3] -> (n, g, g, 3, p, p): row-major patches, (channel, row, col) in each
    cut = tiles.unflatten(1, (g, patch)).unflatten(3, (g, patch)).permute(0, 1, 3, 5, 2, 4)
    out = image_ops.output(out, (n * g * g, 3 * patch * patch))
    image_ops.table_lookup(cut, image_ops.value_table(ip), 3, out.view(cut.shape))
    return out, (n, g, g)


__all__ = ["pixel_shape", "preprocess", "tile_grid", "unsupported"]
