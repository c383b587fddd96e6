"""A page's pixels as the layout step sees them: ``normalise`` (grey, dark text on light,
the background divided out) and ``ink_mask`` (the pixels that are ink), with the running
window filters both use."""
from __future__ import annotations

from typing import Any

import numpy as np

MIN_CONTRAST = 0.25  # darkest ink must be this far below the background, else no text


def box_max(a: np.ndarray, k: int, axis: int) -> np.ndarray:
    """Running maximum over ``k`` values along ``axis`` (edge-padded, same shape): maxima
    of spans doubling in length, then two overlapping spans per output (log k passes)."""
    pad = [(0, 0), (0, 0)]
    pad[axis] = (k // 2, k - 1 - k // 2)
    out, span, n = np.pad(a, pad, mode="edge"), 1, a.shape[axis]

    def cut(x: np.ndarray, start: int, stop: int) -> np.ndarray:
        return x[start:stop] if axis == 0 else x[:, start:stop]

    while span * 2 <= k:
        m = out.shape[axis] - span
        out = np.maximum(cut(out, 0, m), cut(out, span, span + m))
        span *= 2
    # out[i] is the maximum of the span values from i, and span <= k < 2 span
    return np.maximum(cut(out, 0, n), cut(out, k - span, k - span + n))


def box_mean(a: np.ndarray, k: int) -> np.ndarray:
    """Mean over a ``k`` x ``k`` window (edge-padded, same shape), by cumulative sums."""
    p = np.pad(a, ((k // 2 + 1, k - 1 - k // 2), (k // 2 + 1, k - 1 - k // 2)), mode="edge")
    c = p.cumsum(0).cumsum(1)
    return (c[k:, k:] - c[:-k, k:] - c[k:, :-k] + c[:-k, :-k]) / (k * k)


def runs(flags: np.ndarray) -> list[tuple[int, int]]:
    """[start, stop) of each run of True."""
    d = np.diff(np.concatenate([[0], flags.astype(np.int8), [0]]))
    return list(zip(np.nonzero(d == 1)[0].tolist(), np.nonzero(d == -1)[0].tolist()))


def normalise(image: Any) -> np.ndarray:
    """``image`` (PIL) -> float32 [h, w]: background ~1, ink towards 0. Light text on a dark
    page is inverted; dividing by the local background (a running maximum, wider than a
    stroke, smoothed) flattens grey, textured and unevenly lit backgrounds."""
    g = np.asarray(image.convert("L"), dtype=np.float32) / 255.0
    if np.median(g) < 0.5:  # light on dark
        g = 1.0 - g
    k = max(9, min(31, (min(g.shape) // 24) | 1))
    bg = box_max(box_max(g, k, 0), k, 1)
    bg = np.maximum(box_mean(bg, k), 1e-3)
    return np.clip(g / bg, 0.0, 1.0)


def ink_mask(norm: np.ndarray) -> np.ndarray:
    """Ink pixels: below the midpoint between the background (1) and the darkest ink, with
    isolated pixels (noise) removed. All False where there is no contrast to speak of."""
    lo = float(np.percentile(norm, 0.2))
    if lo > 1.0 - MIN_CONTRAST:
        return np.zeros(norm.shape, dtype=bool)
    ink = norm < (1.0 + lo) / 2
    p = np.pad(ink, 1).astype(np.uint8)
    neighbours = sum(p[1 + dy:p.shape[0] - 1 + dy, 1 + dx:p.shape[1] - 1 + dx]
                     for dy in (-1, 0, 1) for dx in (-1, 0, 1)) - ink
    return ink & (neighbours >= 1)
