"""The demo checkpoint's layout step: a page image in, its text lines in reading order out,
each line's pieces as strips in the geometry the model reads (docs/demo-model.md).

    page (PIL) -> ink.normalise (grey, dark on light, background divided out) -> ink mask
    -> skew.skew_angle / rotate (a scan turned up to 5 degrees, set level)
    -> rules.remove_rules (grid lines, separators) -> blocks.blocks (columns, in reading
    order) -> lines.find_lines per block (pieces at word and wide gaps, dot leaders out)
    -> lines.strip per piece

The demo's image processor (demo/processor.py) lays the strips out as the one image the
model reads; `triptych ocr --layout lines` sends them one by one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
from triptych.demo.layout.blocks import blocks
from triptych.demo.layout.ink import ink_mask, normalise
from triptych.demo.layout.lines import (
    BASELINE,
    LINE_HEIGHT,
    MARGIN,
    MAX_WIDTH,
    TOP,
    WORD_GAP,
    Line,
    find_lines,
    strip,
    text_height,
)
from triptych.demo.layout.rules import remove_rules
from triptych.demo.layout.skew import rotate, skew_angle


@dataclass
class Page:
    """A page as read: its normalised pixels (turned level, rules blanked), the angle it
    was turned by, and its lines in reading order."""

    norm: np.ndarray
    angle: float
    lines: list[Line]


def read_page(image: Any) -> Page:
    """The lines of ``image`` (PIL, 8-bit RGB) in reading order."""
    norm = normalise(image)
    ink = ink_mask(norm)
    angle = skew_angle(ink)
    if angle:
        norm = rotate(norm, angle)
        ink = ink_mask(norm)
    norm, ink = remove_rules(norm, ink)
    em = max(4.0, text_height(ink))
    lines = [ln for box in blocks(ink, em) for ln in find_lines(norm, ink=ink, box=box)]
    return Page(norm, angle, lines)


def line_strips(image: Any) -> list[list[Any]]:
    """Each text line of ``image`` (PIL) as its pieces' strips (``strip``), in reading
    order; [] when the image shows no text."""
    page = read_page(image)
    return [[strip(page.norm, ln, p) for p in ln.pieces] for ln in page.lines]


__all__ = [
    "BASELINE",
    "LINE_HEIGHT",
    "MARGIN",
    "MAX_WIDTH",
    "TOP",
    "WORD_GAP",
    "Line",
    "Page",
    "find_lines",
    "line_strips",
    "normalise",
    "read_page",
    "strip",
]
