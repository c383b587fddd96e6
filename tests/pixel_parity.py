"""How close the fast preprocessing path's pixel values must be to HF's processor's.

The fast path (models/image_ops.py) resizes with torch's uint8 antialiased interpolation:
it follows Pillow's resampling with 16-bit weights where Pillow uses 22, so a resized
sample may land one 8-bit level (about 1 in 200) or two (about 1 in a million) from
Pillow's. Everything after the resize is HF's arithmetic exactly (a table of HF's own
values). So: the same shape; every value within two 8-bit levels of HF's after
normalisation; and few values off at all.
"""
from __future__ import annotations

from typing import Any

import torch

MAX_LEVELS = 2
MAX_DIFFERING = 0.02  # of the values (measured: at most ~0.8%, on noise)


def level(ip: Any) -> float:
    """One 8-bit step of the processor's output, in its widest channel."""
    scale = ip.rescale_factor if ip.do_rescale else 1.0
    stds = list(ip.image_std) if ip.do_normalize else [1.0]
    return max(scale / s for s in stds)


def assert_hf_pixels(ours: torch.Tensor, ref: torch.Tensor, ip: Any) -> None:
    assert ours.shape == ref.shape and ours.dtype == ref.dtype == torch.float32
    diff = (ours - ref).abs()
    worst = float(diff.max()) / level(ip) if diff.numel() else 0.0
    assert worst <= MAX_LEVELS + 1e-3, f"{worst:.2f} levels from HF's"
    off = float((diff > 1e-6).float().mean()) if diff.numel() else 0.0
    assert off <= MAX_DIFFERING, f"{off:.2%} of the values differ from HF's"
