"""Image primitives of the fast preprocessing path (``--mm-preprocessor fast``).

HF's PIL image processors resize with Pillow, then rescale and normalise in numpy (float64
then float32), then cut patches with a transpose and copies: ~35-80 ms for a 1080p photo on
one core. The same values, bit for bit, by other means:

- ``resize_u8``: Pillow's resampling itself, its coefficients and integer passes in
  Pillow's order, vectorised (kernels/cpu/image_resample.py; Pillow's own resize where
  that cannot be built). torch's antialiased uint8 interpolation was measured and left:
  it multiplies with 16-bit weights where Pillow uses 22-bit ones, so a sample in ~200
  lands one level off (one in a million two), and HF's logprobs moved by >1e-3.
- ``value_table``: what HF's rescale + normalise make of each 8-bit value of each channel,
  computed once with HF's own arithmetic (float64 rescale, float32 normalise), so a lookup
  is bit for bit HF's value of that sample.
- ``table_lookup``: the lookup, reading uint8 samples through any strided view (the
  patch order is a view of the resized image, nothing is copied to get there) and writing
  float32 once, in the layout the model takes, into a new tensor or the caller's ``out``
  (a shared-memory slot: a 1080p Qwen2-VL image's 50 MB written where they will be read;
  a fresh buffer that size costs about as much in page faults as the whole lookup).

Per-architecture layouts (patch order, tiles) live with their contracts:
models/qwen_vl_image.py, models/internvl_image.py.
"""
from __future__ import annotations

import functools
import math
import warnings
from typing import Any

import numpy as np
import torch
from triptych.engine.device.platform import cpu_kernels

# PIL's codes of the filters the resize serves (kernels/cpu/image_resample.py's), here so
# that importing this module (the API side does, whatever the model's device) imports no
# CPU kernel: the kernel is imported, built or loaded when images are prepared
BICUBIC, BILINEAR = 3, 2


def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int
                 ) -> tuple[int, int]:
    """Qwen-VL's target size: both sides multiples of ``factor``, the area within
    [min_pixels, max_pixels], the aspect ratio kept as well as that allows. HF's rounding
    exactly: Python's round() to the nearest multiple first, then, if the area is out of
    bounds, floor (too large) or ceil (too small) of the side scaled by sqrt(area ratio)."""
    h = round(height / factor) * factor
    w = round(width / factor) * factor
    if h * w > max_pixels:
        beta = math.sqrt(height * width / max_pixels)
        h = max(factor, math.floor(height / beta / factor) * factor)
        w = max(factor, math.floor(width / beta / factor) * factor)
    elif h * w < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h = math.ceil(height * beta / factor) * factor
        w = math.ceil(width * beta / factor) * factor
    return h, w


def supports_resample(resample: Any) -> bool:
    return int(resample) in (BICUBIC, BILINEAR)


def rgb_array(img: Any) -> np.ndarray:
    """[H, W, 3] uint8 of an RGB image: a PIL image's one copy out of Pillow's storage, or
    the array itself."""
    if isinstance(img, np.ndarray):
        if img.ndim != 3 or img.shape[2] != 3 or img.dtype != np.uint8:
            raise ValueError(f"an image array must be [height, width, 3] uint8, got "
                             f"{img.dtype} {list(img.shape)}")
        return img
    if img.mode != "RGB":
        raise ValueError(f"the fast path takes RGB images, got mode {img.mode}")
    return np.asarray(img)


def as_pil(img: Any) -> Any:
    """A PIL image of an RGB image given either way (HF's processor takes PIL images)."""
    from PIL import Image

    return Image.fromarray(img) if isinstance(img, np.ndarray) else img


def as_tensor(rgb: np.ndarray) -> torch.Tensor:
    """[H, W, 3] uint8 as a tensor sharing its memory (read-only is fine: nothing writes)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch's note on read-only arrays
        return torch.from_numpy(rgb)


def load_resize() -> bool:
    """Where images are prepared (P0, the preparation processes), at start rather than on
    the first image: this CPU's copy of the C++ kernels chosen (the platform's choice, once
    per process and logged; the same ``TRIPTYCH_CPU_ISA`` an engine follows) and the resize
    kernel built (once per machine) or loaded. False: Pillow resizes (same bytes, slower)."""
    from triptych.kernels.cpu import image_resample

    cpu_kernels()
    return image_resample.available()


def resize_u8(rgb: torch.Tensor, height: int, width: int, resample: Any = BICUBIC
              ) -> torch.Tensor:
    """[H, W, 3] uint8 -> [height, width, 3] uint8: Pillow's ``resize((width, height),
    resample)`` exactly (the same size: the image itself, as Pillow's copy)."""
    from triptych.kernels.cpu import image_resample

    cpu_kernels()  # the copy of the kernel this CPU runs (a no-op once chosen)
    return image_resample.resize(rgb, height, width, int(resample))


@functools.lru_cache(maxsize=32)
def _table(do_rescale: bool, scale: float, do_normalize: bool, mean: tuple[float, ...],
           std: tuple[float, ...]) -> torch.Tensor:
    v = np.arange(256)
    # HF's rescale: float64 product, then float32; its normalise: float32 arithmetic
    x = (v.astype(np.float64) * scale).astype(np.float32) if do_rescale \
        else v.astype(np.float32)
    rows = []
    for c in range(3):
        y = x
        if do_normalize:
            y = (x - np.float32(mean[c])) / np.float32(std[c])
        rows.append(y.astype(np.float32))
    return torch.from_numpy(np.stack(rows)).contiguous()


def value_table(ip: Any) -> torch.Tensor:
    """[3, 256] float32: HF's processor's value of sample v of channel c (its
    do_rescale / rescale_factor / do_normalize / image_mean / image_std)."""
    def per_channel(x: Any) -> tuple[float, ...]:
        x = list(x) if isinstance(x, (list, tuple)) else [x] * 3
        return tuple(float(v) for v in x)

    return _table(bool(ip.do_rescale), float(ip.rescale_factor), bool(ip.do_normalize),
                  per_channel(ip.image_mean), per_channel(ip.image_std))


def output(out: torch.Tensor | None, shape: tuple[int, ...]) -> torch.Tensor:
    """Where pixel values are written: a new tensor, or the caller's ``out`` (float32,
    contiguous, ``shape``): e.g. a shared-memory slot, written once, in place."""
    if out is None:
        return torch.empty(shape)
    if tuple(out.shape) != shape or out.dtype != torch.float32 or not out.is_contiguous():
        raise ValueError(f"out must be a contiguous float32 tensor of shape {list(shape)}, "
                         f"got {out.dtype} {list(out.shape)}")
    return out


_CHANNEL_BASE = torch.tensor([0, 256, 512], dtype=torch.int32)
_CHUNK_SAMPLES = 1 << 18  # samples looked up per pass (1 MiB of int32 indices)


def table_lookup(samples: torch.Tensor, table: torch.Tensor, channel_dim: int,
                 out: torch.Tensor) -> torch.Tensor:
    """``out[...] = table[c, samples]``: ``samples`` a uint8 view of any strides whose
    ``channel_dim`` holds the 3 channels; ``out`` float32 of the same shape or one it
    broadcasts to (a size-1 dim of ``samples`` is written to every slot of ``out``'s).

    By slices of the first dim, into ``out`` directly: the temporaries stay ~1 MiB, so
    they are reused from the heap slice after slice. (Whole-image temporaries cost ~2x
    the lookup itself in page faults under glibc's default malloc, measured: each call's
    tens of MB went back to the kernel and came back zeroed.)"""
    shape = [1] * samples.dim()
    shape[channel_dim] = 3
    base = _CHANNEL_BASE.view(shape)
    flat = table.view(-1)
    step = max(1, _CHUNK_SAMPLES * samples.shape[0] // max(1, samples.numel()))
    for a in range(0, samples.shape[0], step):
        part = samples[a:a + step]
        idx = torch.empty(part.shape, dtype=torch.int32)
        idx.copy_(part)  # the one pass that walks the strided view
        idx += base
        out[a:a + step].copy_(torch.index_select(flat, 0, idx.view(-1)).view(part.shape))
    return out


__all__ = ["BICUBIC", "BILINEAR", "as_pil", "as_tensor", "output", "resize_u8", "rgb_array",
           "smart_resize", "supports_resample", "table_lookup", "value_table"]
