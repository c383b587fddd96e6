"""Text lines of one block of a page (``find_lines``) and each line's pieces as the demo
model reads them (``strip``).

    ink (demo/layout/ink.py) -> rows with ink (projection profile) -> lines: blocks of ink
    rows, blocks that hold two touching lines split at the valley between their cores, dots
    and accents joined to the nearest line -> each line's ink top and baseline (the bottom
    of its core, the rows of most ink), dot leaders taken out, split left to right at word
    gaps into pieces a strip holds, and always at wide gaps (a price after spaces, a table
    cell) -> each piece resampled so its ink top and baseline fall on rows TOP and BASELINE
    of a LINE_HEIGHT-px strip whose width is a multiple of LINE_HEIGHT, as the training
    renderer prints a line.
"""
from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import numpy as np
from triptych.demo.layout.ink import ink_mask, runs

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
# A gap at least this share of the ink height (about three spaces) always ends a piece: the
# price after a receipt's spaces, the next cell of a table. The model reads one run of
# text per strip; a wide blank inside a strip is where it stopped reading.
WIDE_GAP = 1.3
TOUCH = 0.3  # see _split_touching


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


def _split_touching(profile: np.ndarray, start: int, stop: int, touch: float | None
                    ) -> list[int]:
    """Rows where a block of ink rows holds more than one line (lines set so close that a
    descender touches the ascender below): the lowest row between consecutive cores (runs
    at or above a quarter of the block's peak, at least half the tallest core high), where
    that row holds little ink (a few touching strokes, under TOUCH of the block's mean: a
    row of dot leaders or heavy serifs on one line's baseline is a core of its own, but
    the rows above it are full of letters)."""
    raw = profile[start:stop]
    p = np.convolve(raw, np.ones(3) / 3, mode="same")
    cores = runs(p >= 0.25 * p.max())
    tall = max(b - a for a, b in cores)
    cores = [(a, b) for a, b in cores if b - a >= 0.5 * tall]
    cuts = [b0 + int(np.argmin(p[b0:a1])) for (_, b0), (a1, _) in itertools.pairwise(cores)]
    return [start + c for c in cuts if touch is None or raw[c] <= touch * raw.mean()]


def bands(profile: np.ndarray, touch: float | None = TOUCH) -> list[tuple[int, int]]:
    """The row bands of a page's lines, top to bottom (``touch``: _split_touching's)."""
    found: list[tuple[int, int]] = []
    for a, b in runs(profile > 0):
        cuts = _split_touching(profile, a, b, touch)
        found += list(zip([a] + cuts, cuts + [b]))
    if not found:
        return []
    # A band much lower than the others (an i-dot, an accent, a lone mark) joins the
    # nearest band within half a line; any other stays a line of its own.
    typical = float(np.median([b - a for a, b in found]))
    merged = list(found)
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


def text_height(ink: np.ndarray) -> float:
    """A page's typical line height in pixels (ink top to ink bottom of a line, about an em):
    the median height of the line bands of narrow vertical slices of the page, so that a
    table's vertical rule or two columns out of step spoil only the slices they cross.
    0.0 for a page without ink."""
    width = max(64, ink.shape[1] // 8)
    heights = [b - a for x in range(0, ink.shape[1], width)
               for a, b in bands(ink[:, x:x + width].sum(axis=1)) if b - a >= 3]
    return float(np.median(heights)) if heights else 0.0


def _leaders(band: np.ndarray, base: int, height: int) -> np.ndarray:
    """Columns of ``band`` (its rows, the line's baseline row ``base`` within it) that hold a
    dot leader: four or more small marks on the baseline in a row, each within two line
    heights of the next ("Coffee ........ 3.50", ". . . ."). An ellipsis stays text."""
    cols = band.any(axis=0)
    marks = []
    for a, b in runs(cols):
        rows = np.nonzero(band[:, a:b].any(axis=1))[0]
        small = b - a <= 0.4 * height and rows[-1] - rows[0] < 0.4 * height
        marks.append((a, b, small and abs(rows[-1] + 1 - base) <= 0.25 * height + 1))
    out = np.zeros(cols.shape, dtype=bool)
    i = 0
    while i < len(marks):
        j = i
        while j < len(marks) and marks[j][2] and (j == i or marks[j][0] - marks[j - 1][1]
                                                  <= 2 * height):
            j += 1
        if j - i >= 4:
            out[marks[i][0]:marks[j - 1][1]] = True
        i = max(j, i + 1)
    return out


def _pieces(cols: np.ndarray, height: int, max_width: float, word_gap: float,
            wide_gap: float | None) -> tuple[tuple[int, int], ...]:
    """Column ranges of one line's ink, split at word gaps (blank runs at least ``word_gap``
    of the ink height) so that each is at most ``max_width`` px wide where gaps allow, and
    at every gap of at least ``wide_gap`` of the ink height."""
    words: list[list[int]] = []
    for a, b in runs(cols > 0):
        if words and a - words[-1][1] < max(2, height * word_gap):
            words[-1][1] = b
        else:
            words.append([a, b])
    pieces: list[list[int]] = []
    for a, b in words:
        wide = wide_gap is not None and pieces and a - pieces[-1][1] >= height * wide_gap
        if pieces and b - pieces[-1][0] <= max_width and not wide:
            pieces[-1][1] = b
        else:
            pieces.append([a, b])
    return tuple((a, b) for a, b in pieces)


def find_lines(norm: np.ndarray, max_width: float | None = None,
               word_gap: float | None = None, *, ink: np.ndarray | None = None,
               box: tuple[int, int, int, int] | None = None,
               wide_gap: float | None = WIDE_GAP, leaders: bool = True,
               touch: float | None = TOUCH) -> list[Line]:
    """The text lines of a normalised page (``normalise``), top to bottom, in page pixels;
    pieces up to ``max_width`` (MAX_WIDTH) strip pixels, split at gaps of ``word_gap``
    (WORD_GAP) and always at ``wide_gap`` (None: never), dot leaders taken out
    (``leaders``), touching lines split where few strokes touch (``touch``; None: at every
    valley between cores). ``ink``: the page's ink mask (default: ``ink_mask(norm)``); ``box``:
    (top, bottom, left, right), the block to read (default: the whole page)."""
    max_width = MAX_WIDTH if max_width is None else max_width
    word_gap = WORD_GAP if word_gap is None else word_gap
    ink = ink_mask(norm) if ink is None else ink
    y0, y1, x0, x1 = box or (0, ink.shape[0], 0, ink.shape[1])
    block = ink[y0:y1, x0:x1]
    lines = []
    for top, bottom in bands(block.sum(axis=1), touch):
        band = block[top:bottom]
        rows, cols = np.nonzero(band.any(axis=1))[0], band.sum(axis=0)
        if len(rows) == 0 or band.sum() < 6:
            continue
        t = int(rows[0])
        profile = band.sum(axis=1)
        base = int(np.nonzero(profile >= 0.35 * profile.max())[0][-1]) + 1
        h = base - t
        if leaders:
            cols = np.where(_leaders(band, base, h), 0, cols)
        xs = np.nonzero(cols)[0]
        if len(xs) == 0:
            continue
        pieces = _pieces(cols, h, max_width * h / (BASELINE - TOP), word_gap, wide_gap)
        lines.append(Line(y0 + top, y0 + bottom, y0 + top + t, y0 + top + base, x0 + int(xs[0]),
                          x0 + int(xs[-1]) + 1, tuple((x0 + a, x0 + b) for a, b in pieces)))
    return lines


def strip(norm: np.ndarray, line: Line, piece: tuple[int, int], margin: int | None = None
          ) -> Any:
    """One piece of a line as the model reads it: a LINE_HEIGHT-px-high RGB strip, the ink
    top on row TOP and the baseline on row BASELINE, ``margin`` (MARGIN) px of background
    before it, width a multiple of LINE_HEIGHT; contrast stretched so the darkest ink is
    black; rows and columns of other lines and pieces blanked."""
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
