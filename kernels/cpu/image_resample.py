"""Pillow's bicubic / bilinear resize of 8-bit images, bit for bit, faster (C++ passes:
``csrc/image_resample/``). The resize of the fast image preprocessing path
(models/image_ops.py); it runs where images are prepared (P0, preparation processes),
whatever device the model is on.

``resize(rgb, height, width, resample)``: [H, W, C] uint8 -> [height, width, C] uint8 equal
to ``Image.fromarray(rgb).resize((width, height), resample)``. How:

- the coefficients of each pass are Pillow's (libImaging/Resample.c ``precompute_coeffs``
  and ``normalize_coeffs_8bpc``), computed here in float64 in Pillow's order of operations
  (a sequential sum, the same filter polynomial), then scaled to 22-bit integers with
  Pillow's rounding;
- the two passes are Pillow's integer passes (the C++ library: one copy per instruction
  set, ``isa.py``; each call runs the copy the platform chose, so the process must have
  called ``engine.device.platform.cpu_kernels()`` first, as ``image_ops.resize_u8`` does; every
  copy computes the same integers), in Pillow's order:
  Pillow 13 runs the vertical pass first when the height shrinks by more than twice what
  the width does (before 13: always horizontal first). Each pass rounds to 8 bits, so the
  order shows in the result.

Built on first use by ``cpu_build`` (once per machine, cached); where it cannot be built
(no compiler) ``resize`` runs Pillow's own resize instead: the same bytes, at Pillow's
speed (``available()`` says which, and logs why once).
"""
from __future__ import annotations

import functools
import logging

import numpy as np
import PIL
import torch
from triptych.kernels.cpu import build as cpu_build
from triptych.kernels.cpu import isa

logger = logging.getLogger("triptych.image_resample")

LIBRARY = "image_resample"
BICUBIC, BILINEAR = 3, 2  # PIL's resample codes served (their filters are pure arithmetic)
PRECISION_BITS = 22  # Pillow's: 32 - 8 bits of result - 2 bits of headroom
_SUPPORT = {BICUBIC: 2.0, BILINEAR: 1.0}
_VERTICAL_FIRST_RULE = int(PIL.__version__.split(".")[0]) >= 13


def available() -> bool:
    """Whether the C++ passes are built and loaded here (else Pillow resizes)."""
    return cpu_build.usable(LIBRARY, logger, "the image resize kernel is unavailable: the "
                            "fast preprocessing path resizes with Pillow (same pixels, slower)")


@functools.cache
def _built() -> tuple[int, ...]:
    return tuple(torch.ops.triptych_image.variants())


def variant_id() -> int:
    """The variant this process runs (the platform's choice, as far as this build holds it)."""
    return isa.variant_id(LIBRARY, _built())


def _filter(resample: int, x: np.ndarray) -> np.ndarray:
    x = np.abs(x)
    if resample == BILINEAR:
        return np.where(x < 1.0, 1.0 - x, 0.0)
    # bicubic, a = -0.5, evaluated as Pillow's C does: ((a + 2) x - (a + 3)) x x + 1 near,
    # (((x - 5) x + 8) x - 4) a farther
    near = (1.5 * x - 2.5) * x * x + 1.0
    far = (((x - 5.0) * x + 8.0) * x - 4.0) * -0.5
    return np.where(x < 1.0, near, np.where(x < 2.0, far, 0.0))


@functools.lru_cache(maxsize=64)
def coefficients(in_size: int, out_size: int, resample: int
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Pillow's taps of one pass: (bounds int32 [out, 2] = first input, count; weights
    int32 [out, taps], scaled by 2^22)."""
    scale = in_size / out_size
    filterscale = max(scale, 1.0)
    support = _SUPPORT[resample] * filterscale
    taps = int(np.ceil(support)) * 2 + 1
    center = (np.arange(out_size) + 0.5) * scale
    first = np.maximum((center - support + 0.5).astype(np.int64), 0)  # C's (int): truncates
    last = np.minimum((center + support + 0.5).astype(np.int64), in_size)
    count = last - first
    k = np.arange(taps)
    valid = k[None, :] < count[:, None]
    w = _filter(resample, ((k[None, :] + first[:, None]) - center[:, None] + 0.5)
                * (1.0 / filterscale))
    w = np.where(valid, w, 0.0)
    total = np.zeros(out_size)
    for i in range(taps):  # Pillow sums tap by tap: keep its rounding
        total = total + w[:, i]
    w = np.where(total[:, None] != 0.0, w / np.where(total == 0.0, 1.0, total)[:, None], w)
    scaled = w * float(1 << PRECISION_BITS)
    fixed = np.trunc(np.where(scaled < 0, scaled - 0.5, scaled + 0.5)).astype(np.int32)
    bounds = np.stack([first, count], 1).astype(np.int32)
    return torch.from_numpy(bounds), torch.from_numpy(np.ascontiguousarray(fixed))


def vertical_first(h_in: int, w_in: int, h_out: int, w_out: int) -> bool:
    """Pillow's order of the two passes (libImaging/Resample.c, ImagingResampleInner)."""
    shrink_h, shrink_w = h_in - h_out, w_in - w_out
    return _VERTICAL_FIRST_RULE and shrink_h > 0 and shrink_h > 2 * shrink_w


def resize(rgb: torch.Tensor, height: int, width: int, resample: int = BICUBIC,
           variant: int | None = None) -> torch.Tensor:
    """[H, W, C] uint8 (contiguous) -> [height, width, C] uint8, Pillow's bytes exactly.
    The same size is returned as it is (Pillow copies it unchanged). ``variant`` (an
    ``isa.NAMES`` index; tests): another copy than the platform's choice."""
    if resample not in _SUPPORT:
        raise ValueError(f"resample {resample}: only bicubic ({BICUBIC}) and bilinear "
                         f"({BILINEAR}) are served")
    h, w, c = rgb.shape
    if (h, w) == (height, width):
        return rgb
    if not available():
        return _pillow(rgb, height, width, resample)
    ops = torch.ops.triptych_image
    v = variant_id() if variant is None else variant
    rgb = rgb.contiguous()

    def rows(x: torch.Tensor) -> torch.Tensor:
        if x.shape[0] == height:
            return x
        b, k = coefficients(x.shape[0], height, resample)
        return ops.resample_rows(x.view(x.shape[0], -1), b, k, v).view(height, x.shape[1], c)

    def cols(x: torch.Tensor) -> torch.Tensor:
        if x.shape[1] == width:
            return x
        b, k = coefficients(x.shape[1], width, resample)
        return ops.resample_cols(x, b, k, v)

    if vertical_first(h, w, height, width):
        return cols(rows(rgb))
    return rows(cols(rgb))


def _pillow(rgb: torch.Tensor, height: int, width: int, resample: int) -> torch.Tensor:
    from PIL import Image

    arr = rgb.numpy()
    img = Image.fromarray(arr[..., 0] if arr.shape[2] == 1 else arr)
    out = np.asarray(img.resize((width, height), resample))
    return torch.from_numpy(np.array(out.reshape(height, width, -1)))


__all__ = ["BICUBIC", "BILINEAR", "available", "coefficients", "resize", "variant_id",
           "vertical_first"]
