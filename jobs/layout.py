"""The layout step of `triptych ocr` for a model that reads one line at a time (the demo).

    page (RGB) -> grey, dark text on light (light-on-dark inverted), divided by the local
    background (grey and textured backgrounds, uneven light) -> ink mask (despeckled)
    -> rows with ink (projection profile) -> lines: blocks of ink rows, blocks that hold two
    touching lines split at the valley between their cores, dots and accents joined to
    the nearest line -> each line's ink top and baseline (the bottom of its core, the rows
    of most ink), split left to right at word gaps into pieces a strip holds -> each piece
    resampled so its ink top and baseline fall on rows TOP and BASELINE of a
    LINE_HEIGHT-px strip whose width is a multiple of LINE_HEIGHT, as the training renderer
    prints a line (the processor keeps such an image as it is: one band of merged vision
    tokens).

Reading order: lines top to bottom, pieces left to right (one column).
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np

LINE_HEIGHT = 28  # one merged vision token: patch 14 x spatial merge 2 (demo/render.py ROW)
# Where training lines have their text (demo/render.py, fonts 16-20 px on a 28-px strip):
# capitals and ascenders from row 7, the baseline at row 20 (19-21 by font).
TOP, BASELINE = 7, 20
# Widest ink of a piece, px at that scale: longer lines are split at word gaps. Training
# lines run to ~420 px, but the demo model reads short pieces better: on the dev set
# (demo/heldout.py DEV_SEED, 400 lines + 80 screenshots) 420 px read at 5.2% CER, 300 at
# 3.6%, 224-252 at ~2.8%, with a margin of 9 px (6: 3.6% at 300 px; 3: worse).
MAX_WIDTH = 224
MARGIN = 9  # px left of the ink on a strip (training: 2-10)
# A blank column run at least this share of the ink height (ink top to baseline) is a word
# gap, where a line may be split; narrower runs are gaps between letters. Dev set: 0.25 read
# at 2.8% CER (a space read between letters that stand apart), 0.4 at 2.1%, 0.55 at 2.5%.
WORD_GAP = 0.4
MIN_CONTRAST = 0.25  # darkest ink must be this far below the background, else no text


@dataclass(frozen=True)
class Line:
    """One text line of a page, in page pixels: its band (``top``..``bottom``, the rows that
    are its own), its ink box, and its pieces (column ranges split at word gaps)."""

    top: int
    bottom: int
    ink_top: int
    baseline: int  # the row below the last row of the line's core (its x-height band)
    left: int
    right: int
    pieces: tuple[tuple[int, int], ...]

    @property
    def scale(self) -> float:
        """Page pixels -> strip pixels: the ink top to the baseline as in training."""
        return (BASELINE - TOP) / max(self.baseline - self.ink_top, 1)


def _box_max(a: np.ndarray, k: int, axis: int) -> np.ndarray:
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


def _box_mean(a: np.ndarray, k: int) -> np.ndarray:
    """Mean over a ``k`` x ``k`` window (edge-padded, same shape), by cumulative sums."""
    p = np.pad(a, ((k // 2 + 1, k - 1 - k // 2), (k // 2 + 1, k - 1 - k // 2)), mode="edge")
    c = p.cumsum(0).cumsum(1)
    return (c[k:, k:] - c[:-k, k:] - c[k:, :-k] + c[:-k, :-k]) / (k * k)


def normalise(image: Any) -> np.ndarray:
    """``image`` (PIL) -> float32 [h, w]: background ~1, ink towards 0. Light text on a dark
    page is inverted; dividing by the local background (a running maximum, wider than a
    stroke, smoothed) flattens grey, textured and unevenly lit backgrounds."""
    g = np.asarray(image.convert("L"), dtype=np.float32) / 255.0
    if np.median(g) < 0.5:  # light on dark
        g = 1.0 - g
    k = max(9, min(31, (min(g.shape) // 24) | 1))
    bg = _box_max(_box_max(g, k, 0), k, 1)
    bg = np.maximum(_box_mean(bg, k), 1e-3)
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


def _runs(flags: np.ndarray) -> list[tuple[int, int]]:
    """[start, stop) of each run of True."""
    d = np.diff(np.concatenate([[0], flags.astype(np.int8), [0]]))
    return list(zip(np.nonzero(d == 1)[0].tolist(), np.nonzero(d == -1)[0].tolist()))


def _split_touching(profile: np.ndarray, start: int, stop: int) -> list[int]:
    """Rows where a block of ink rows holds more than one line (lines set so close that a
    descender touches the ascender below): the lowest row between consecutive cores (runs
    at or above a quarter of the block's peak, at least half the tallest core high)."""
    p = np.convolve(profile[start:stop], np.ones(3) / 3, mode="same")
    cores = _runs(p >= 0.25 * p.max())
    tall = max(b - a for a, b in cores)
    cores = [(a, b) for a, b in cores if b - a >= 0.5 * tall]
    return [start + b0 + int(np.argmin(p[b0:a1])) for (_, b0), (a1, _) in itertools.pairwise(cores)]


def _bands(profile: np.ndarray) -> list[tuple[int, int]]:
    """The row bands of a page's lines, top to bottom."""
    bands: list[tuple[int, int]] = []
    for a, b in _runs(profile > 0):
        cuts = _split_touching(profile, a, b)
        bands += list(zip([a] + cuts, cuts + [b]))
    if not bands:
        return []
    # A band much lower than the others (an i-dot, an accent, a lone mark) joins the
    # nearest band within half a line; any other stays a line of its own.
    typical = float(np.median([b - a for a, b in bands]))
    merged = list(bands)
    i = 0
    while i < len(merged) and len(merged) > 1:
        a, b = merged[i]
        if b - a >= 0.5 * typical:
            i += 1
            continue
        gaps = [(merged[j][0] - b if j > i else a - merged[j][1], j) for j in (i - 1, i + 1)
                if 0 <= j < len(merged)]
        gap, j = min(gaps)
        if gap > 0.5 * typical:
            i += 1
            continue
        lo, hi = sorted((i, j))
        merged[lo:hi + 1] = [(merged[lo][0], merged[hi][1])]
        i = lo
    return merged


def _pieces(cols: np.ndarray, height: int, max_width: float, word_gap: float
            ) -> tuple[tuple[int, int], ...]:
    """Column ranges of one line's ink, split at word gaps (blank runs at least ``word_gap``
    of the ink height) so that each is at most ``max_width`` px wide where gaps allow."""
    runs = _runs(cols > 0)
    words: list[list[int]] = []
    for a, b in runs:
        if words and a - words[-1][1] < max(2, height * word_gap):
            words[-1][1] = b
        else:
            words.append([a, b])
    pieces: list[list[int]] = []
    for a, b in words:
        if pieces and b - pieces[-1][0] <= max_width:
            pieces[-1][1] = b
        else:
            pieces.append([a, b])
    return tuple((a, b) for a, b in pieces)


def find_lines(norm: np.ndarray, max_width: float | None = None,
               word_gap: float | None = None) -> list[Line]:
    """The text lines of a normalised page (``normalise``), in reading order; pieces up to
    ``max_width`` (MAX_WIDTH) strip pixels, split at gaps of ``word_gap`` (WORD_GAP)."""
    max_width = MAX_WIDTH if max_width is None else max_width
    word_gap = WORD_GAP if word_gap is None else word_gap
    ink = ink_mask(norm)
    lines = []
    for top, bottom in _bands(ink.sum(axis=1)):
        band = ink[top:bottom]
        rows, cols = np.nonzero(band.any(axis=1))[0], band.sum(axis=0)
        if len(rows) == 0 or band.sum() < 6:
            continue
        t = top + int(rows[0])
        profile = band.sum(axis=1)
        base = top + int(np.nonzero(profile >= 0.35 * profile.max())[0][-1]) + 1
        xs = np.nonzero(cols)[0]
        h = base - t
        pieces = _pieces(cols, h, max_width * h / (BASELINE - TOP), word_gap)
        lines.append(Line(top, bottom, t, base, int(xs[0]), int(xs[-1]) + 1, pieces))
    return lines


def strip(norm: np.ndarray, line: Line, piece: tuple[int, int], margin: int | None = None
          ) -> Any:
    """One piece of a line as the model reads it: a LINE_HEIGHT-px-high RGB strip, the ink
    top on row TOP and the baseline on row BASELINE, ``margin`` (MARGIN) px of background
    before it,
    width a multiple of LINE_HEIGHT; contrast stretched so the darkest ink is black; rows
    and columns of other lines and pieces blanked."""
    from PIL import Image

    s = line.scale
    margin = MARGIN if margin is None else margin
    width = -(-(round((piece[1] - piece[0]) * s) + 2 * margin) // LINE_HEIGHT) * LINE_HEIGHT
    # The strip's source region in page pixels (edges, fractional): the ink top edge maps
    # to row TOP, the baseline to row BASELINE, the piece's left edge to column margin.
    sx0, sy0 = piece[0] - margin / s, line.ink_top - TOP / s
    sx1, sy1 = sx0 + width / s, sy0 + LINE_HEIGHT / s
    ix0, iy0, ix1, iy1 = int(sx0) - 2, int(sy0) - 2, int(sx1) + 2, int(sy1) + 2
    crop = np.ones((iy1 - iy0, ix1 - ix0), dtype=np.float32)  # background beyond the page
    # Only this line's rows and this piece's columns (+1 px of antialiasing) are copied.
    ya, yb = max(iy0, line.top), min(iy1, line.bottom, norm.shape[0])
    xa, xb = max(ix0, piece[0] - 1, 0), min(ix1, piece[1] + 1, norm.shape[1])
    if ya < yb and xa < xb:
        crop[ya - iy0:yb - iy0, xa - ix0:xb - ix0] = norm[ya:yb, xa:xb]
    lo = float(crop.min())
    crop = np.clip((crop - lo) / max(1.0 - lo, 1e-3), 0.0, 1.0)
    src = Image.fromarray((crop * 255).round().astype(np.uint8))
    box = (sx0 - ix0, sy0 - iy0, sx1 - ix0, sy1 - iy0)
    return src.resize((width, LINE_HEIGHT), Image.Resampling.LANCZOS, box=box).convert("RGB")


def line_strips(image: Any) -> list[list[Any]]:
    """Each text line of ``image`` (PIL) as its pieces' strips (``strip``), in reading
    order; [] when the image shows no text."""
    norm = normalise(image)
    return [[strip(norm, ln, p) for p in ln.pieces] for ln in find_lines(norm)]


__all__ = ["LINE_HEIGHT", "Line", "find_lines", "line_strips", "normalise",
           "strip"]
