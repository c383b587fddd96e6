"""A crooked scan set straight: the page's skew (up to ``MAX_ANGLE`` degrees) is the angle at
which its ink rows line up best, and the normalised page is turned back by it.

    ink pixels (a sample) -> for each angle a, rows y - x tan(a) -> histogram -> the sum of
    its squares peaks when text lines fall on as few rows as they can (coarse, then fine)
"""
from __future__ import annotations

import math

import numpy as np

MAX_ANGLE = 5.0  # degrees either way
# Smaller skews are left alone: a line's ink rows are the same within a pixel or two over
# the width of a page, and every pixel of an unturned page stays exactly as it was.
MIN_ANGLE = 0.3
_SAMPLE = 60_000  # ink pixels scored per angle (a page has far more; rows need few)


def _score(ys: np.ndarray, xs: np.ndarray, angle: float, rows: int) -> float:
    y = np.round(ys - xs * math.tan(math.radians(angle))).astype(np.int64)
    counts = np.bincount(y - y.min(), minlength=rows)
    return float((counts.astype(np.float64) ** 2).sum())


def skew_angle(ink: np.ndarray) -> float:
    """The page's skew in degrees (positive: lines fall to the right, as a page turned
    clockwise), 0.0 when it is under MIN_ANGLE or the page has too little ink to tell."""
    ys, xs = np.nonzero(ink)
    if len(ys) < 50 or np.ptp(xs) < 40:
        return 0.0
    if len(ys) > _SAMPLE:  # an even sample: the same pixels every time
        pick = np.linspace(0, len(ys) - 1, _SAMPLE).astype(np.int64)
        ys, xs = ys[pick], xs[pick]
    ys, xs = ys.astype(np.float64), xs.astype(np.float64) - xs.mean()
    rows = ink.shape[0] * 2
    coarse = np.arange(-MAX_ANGLE, MAX_ANGLE + 1e-9, 0.25)
    best = max(coarse, key=lambda a: _score(ys, xs, a, rows))
    fine = np.arange(best - 0.25, best + 0.25 + 1e-9, 0.05)
    best = float(max(fine, key=lambda a: _score(ys, xs, a, rows)))
    # NOTE: a tie with 0 (a single short line, a blank page) stays unturned
    if abs(best) < MIN_ANGLE or _score(ys, xs, best, rows) <= 1.02 * _score(ys, xs, 0.0, rows):
        return 0.0
    return round(best, 2)


def rotate(norm: np.ndarray, angle: float) -> np.ndarray:
    """``norm`` (background 1) turned by ``-angle`` degrees about its centre, so lines that
    fell by ``angle`` run level; the canvas grows to hold every pixel, new area background."""
    from PIL import Image

    img = Image.fromarray(norm.astype(np.float32), mode="F")
    out = img.rotate(angle, resample=Image.Resampling.BICUBIC, expand=True, fillcolor=1.0)
    return np.clip(np.asarray(out, dtype=np.float32), 0.0, 1.0)
