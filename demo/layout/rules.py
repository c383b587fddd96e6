"""Rules and grid lines taken off a page before its lines are found: a table's grid, a
receipt's dashed or solid separators, an underline running under a whole line.

A horizontal rule is a run of ink far longer than any letter stroke (``RULE_LINES`` times the
page's line height, a morphological opening along the row); a vertical one likewise along the
column, or shorter when it joins two horizontal rules (a one-row table's cell walls). What
is taken off is blanked in the normalised page too, so no strip shows it.
"""
from __future__ import annotations

import numpy as np
from triptych.demo.layout.ink import box_max
from triptych.demo.layout.lines import text_height

# A straight run this many line heights long is no letter's stroke: horizontal 3, vertical 2.2
# (brackets, bars and a "$" reach ~1.2 em).
RULE_LINES = (3.0, 2.2)


def _opening(ink: np.ndarray, k: int, axis: int) -> np.ndarray:
    """The pixels of ``ink`` on a straight run of at least ``k`` along ``axis``."""
    if k <= 1 or k > ink.shape[axis]:
        return np.zeros_like(ink) if k > ink.shape[axis] else ink.copy()
    inside = ~box_max((~ink).astype(np.uint8), k, axis).astype(bool)  # erosion
    return box_max(inside.astype(np.uint8), k, axis).astype(bool)  # dilation


def rule_mask(ink: np.ndarray) -> np.ndarray:
    """The ink pixels of ``ink`` that belong to horizontal or vertical rules."""
    h = text_height(ink)
    if h == 0:
        return np.zeros_like(ink)
    horiz = _opening(ink, max(24, round(RULE_LINES[0] * h)), 1)
    vert = _opening(ink, max(24, round(RULE_LINES[1] * h)), 0)
    if horiz.any():  # shorter walls between two horizontal rules: a table's cells
        near = box_max(horiz.astype(np.uint8), 5, 0).astype(bool)
        for x in np.nonzero((ink & ~vert).any(axis=0) & near.any(axis=0))[0]:
            col = ink[:, x]
            d = np.diff(np.concatenate([[0], col.astype(np.int8), [0]]))
            for a, b in zip(np.nonzero(d == 1)[0], np.nonzero(d == -1)[0]):
                if b - a >= 0.5 * h and near[a, x] and near[b - 1, x]:
                    vert[a:b, x] = True
    return horiz | vert


def remove_rules(norm: np.ndarray, ink: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(``norm``, ``ink``) with the rules blanked: background in the page (a pixel around
    each, its antialiasing), not ink in the mask."""
    rules = rule_mask(ink)
    if not rules.any():
        return norm, ink
    wide = box_max(box_max(rules.astype(np.uint8), 3, 0), 3, 1).astype(bool)
    return np.where(wide, 1.0, norm).astype(np.float32), ink & ~wide
