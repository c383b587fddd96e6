"""A page cut into blocks in reading order (recursive XY-cut): a column of an article is
read to its end before the next; a table or a receipt is not cut into columns, so it reads
row by row.

    block -> its ink box -> a blank column run at least GUTTER em wide from its top to its
    bottom, with running text on both sides (COLUMN_EMS-wide lines, two or more of them):
    left block, then right block (no wide blanks inside their lines: a table's or a
    receipt's rows have them) -> else the widest blank row run at least PARAGRAPH em
    high: upper block, then lower -> else one block, read line by line

An em here is the page's line height (demo/layout/lines.py ``text_height``).
"""
from __future__ import annotations

import numpy as np
from triptych.demo.layout.ink import runs
from triptych.demo.layout.lines import bands

Box = tuple[int, int, int, int]  # top, bottom, left, right (page pixels, end exclusive)
GUTTER = 1.2  # em: narrower blank columns are word spaces
PARAGRAPH = 0.8  # em: narrower blank rows are the space between two lines
COLUMN_EMS = 8.0  # a side whose lines are narrower (prices, table cells) is not a column
COLUMN_LINES = 3  # nor one of fewer lines (two lines' word gaps can line up by chance)
CELL_GAP, CELL_LINES = 1.4, 0.2  # nor one whose lines are cells apart (see _running_text)


def _shrink(ink: np.ndarray, box: Box) -> Box | None:
    y0, y1, x0, x1 = box
    region = ink[y0:y1, x0:x1]
    rows, cols = np.nonzero(region.any(axis=1))[0], np.nonzero(region.any(axis=0))[0]
    if len(rows) == 0:
        return None
    return y0 + int(rows[0]), y0 + int(rows[-1]) + 1, x0 + int(cols[0]), x0 + int(cols[-1]) + 1


def _running_text(ink: np.ndarray, box: Box, em: float) -> bool:
    """Whether ``box`` holds COLUMN_LINES or more lines of running text: their median ink
    width COLUMN_EMS em, and few of them (CELL_LINES) with a blank of CELL_GAP em inside,
    as a table's row has between its cells and a receipt's between item and price."""
    y0, y1, x0, x1 = box
    region = ink[y0:y1, x0:x1]
    widths, cells = [], 0
    for a, b in bands(region.sum(axis=1)):
        cols = region[a:b].any(axis=0)
        xs = np.nonzero(cols)[0]
        if b - a < 0.5 * em or len(xs) == 0:
            continue
        widths.append(xs[-1] + 1 - xs[0])
        gaps = [g1 - g0 for g0, g1 in runs(~cols[xs[0]:xs[-1]])]
        cells += max(gaps, default=0) >= CELL_GAP * em
    return (len(widths) >= COLUMN_LINES and float(np.median(widths)) >= COLUMN_EMS * em
            and cells <= CELL_LINES * len(widths))


def blocks(ink: np.ndarray, em: float, box: Box | None = None) -> list[Box]:
    """The blocks of ``ink`` (within ``box``) in reading order; ``em`` in pixels."""
    found = _shrink(ink, box or (0, ink.shape[0], 0, ink.shape[1]))
    if found is None:
        return []
    y0, y1, x0, x1 = found
    region = ink[y0:y1, x0:x1]
    gutters = sorted(((b - a, a, b) for a, b in runs(~region.any(axis=0))
                      if b - a >= GUTTER * em), reverse=True)
    for _, a, b in gutters:
        left, right = (y0, y1, x0, x0 + a), (y0, y1, x0 + b, x1)
        if _running_text(ink, left, em) and _running_text(ink, right, em):
            return blocks(ink, em, left) + blocks(ink, em, right)
    gaps = [(b - a, a, b) for a, b in runs(~region.any(axis=1)) if b - a >= PARAGRAPH * em]
    if gaps:
        _, a, b = max(gaps)
        return blocks(ink, em, (y0, y0 + a, x0, x1)) + blocks(ink, em, (y0 + b, y1, x0, x1))
    return [found]
