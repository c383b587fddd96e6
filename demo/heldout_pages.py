"""Held-out pages of the kinds a newcomer tries after a clean line (docs/demo-model.md): a
receipt (items and prices after spaces or dot leaders, a rule before the total), a
two-column article under a title, a table with or without its grid, a scan turned up to 4
degrees with noise and JPEG, a dark terminal. Drawn like demo/heldout.py's set (its text,
its faces, training never prints these pages), from ``heldout.SEED + 3`` for the figures
and ``heldout.DEV_SEED + 3`` for choices. A line's transcription is its text with every
gap (spaces, leaders, a cell wall) read as one space; lines join with newlines, a column's
lines before the next column's."""
from __future__ import annotations

import random
import textwrap
from typing import Any

from triptych.demo import heldout

KINDS = ["receipt", "columns", "table", "scan", "terminal"]
_MONO = ("DejaVu Sans Mono", "DejaVuSansMono.ttf")


def _words(rng: random.Random, n: int) -> str:
    return " ".join(heldout.sample_text(rng, 12).split()[:1][0] for _ in range(n))


def _canvas(w: int, h: int, bg: tuple[int, int, int] = (255, 255, 255)) -> tuple[Any, Any]:
    from PIL import Image, ImageDraw

    img = Image.new("RGB", (w, h), bg)
    return img, ImageDraw.Draw(img)


def receipt(rng: random.Random, fnt: Any, size: int) -> tuple[Any, list[str]]:
    items = [(_words(rng, rng.randint(1, 3)), f"{rng.randint(0, 99)}.{rng.randint(0, 99):02d}")
             for _ in range(rng.randint(4, 8))]
    items.append(("TOTAL", f"{rng.randint(10, 999)}.{rng.randint(0, 99):02d}"))
    leaders, step = rng.random() < 0.5, int(size * 1.5)
    right = int(max(fnt.getlength(a) for a, _ in items) + 8 * size)
    img, d = _canvas(right + 40, step * (len(items) + 3) + 20, (252, 250, 244))
    head = _words(rng, 2).upper()
    d.text((20, 12), head, font=fnt, fill=0)
    y = 12 + step
    for k, (a, b) in enumerate(items):
        y += step
        if k == len(items) - 1:  # a rule between the items and the total
            d.line((20, y + size // 4, right, y + size // 4), fill=0, width=1)
            y += size // 2
        d.text((20, y), a, font=fnt, fill=0)
        d.text((right - fnt.getlength(b), y), b, font=fnt, fill=0)
        x = 20 + fnt.getlength(a) + size // 2
        while leaders and x < right - fnt.getlength(b) - size:
            d.text((x, y), ".", font=fnt, fill=0)
            x += fnt.getlength(". ")
    return img, [head] + [f"{a} {b}" for a, b in items]


def columns(rng: random.Random, fnt: Any, size: int) -> tuple[Any, list[str]]:
    title = heldout.sample_text(rng, 30)
    chars = rng.randint(26, 36)
    cols = [textwrap.wrap(" ".join(heldout.sample_text(rng, 40) for _ in range(6)), chars)
            [:rng.randint(5, 10)] for _ in range(2)]
    width = int(max(fnt.getlength(t) for c in cols for t in c))
    gutter, step = int(size * rng.uniform(1.5, 3.0)), int(size * 1.4)
    img, d = _canvas(2 * width + gutter + 60, 40 + 2 * step + step * max(map(len, cols)))
    d.text((30, 20), title, font=fnt, fill=0)
    for c, lines in enumerate(cols):
        for i, t in enumerate(lines):
            d.text((30 + c * (width + gutter), 20 + 2 * step + i * step), t, font=fnt, fill=0)
    return img, [title] + cols[0] + cols[1]


def table(rng: random.Random, fnt: Any, size: int) -> tuple[Any, list[str]]:
    ncol, nrow = rng.randint(3, 5), rng.randint(3, 6)
    kinds = [lambda: _words(rng, 1), lambda: str(rng.randint(1, 999)),
             lambda: f"${rng.randint(1, 999)}.{rng.randint(0, 99):02d}"]
    cells = [[_words(rng, 1).capitalize() for _ in range(ncol)]] + \
        [[kinds[min(c, 2)]() for c in range(ncol)] for _ in range(nrow)]
    widths = [int(max(fnt.getlength(r[c]) for r in cells)) + size for c in range(ncol)]
    xs = [10]
    for w in widths:
        xs.append(xs[-1] + w)
    step = int(size * 1.9)
    img, d = _canvas(xs[-1] + 20, step * len(cells) + 30)
    for r, row in enumerate(cells):
        for c, cell in enumerate(row):
            d.text((xs[c] + size // 2, 15 + r * step + size // 3), cell, font=fnt, fill=0)
    if rng.random() < 0.7:  # the grid
        for r in range(len(cells) + 1):
            d.line((xs[0], 10 + r * step, xs[-1], 10 + r * step), fill=0, width=rng.randint(1, 2))
        for x in xs:
            d.line((x, 10, x, 10 + len(cells) * step), fill=0, width=rng.randint(1, 2))
    return img, [" ".join(row) for row in cells]


def scan(rng: random.Random, fnt: Any, size: int) -> tuple[Any, list[str]]:
    from PIL import Image

    lines = [heldout.sample_text(rng, 40) for _ in range(rng.randint(3, 8))]
    img = heldout.render_lines(rng, lines, fnt, rng.choice(["white", "grey"]), "none",
                               spacing=(1.2, 1.6), margins=(30, 60))
    angle = rng.choice([-1, 1]) * rng.uniform(0.5, 4.0)
    img = img.rotate(angle, resample=Image.Resampling.BICUBIC, expand=True,
                     fillcolor=img.getpixel((0, 0)))
    return heldout._degrade(rng, img, rng.choice(["blur", "jpeg"])), lines


def terminal(rng: random.Random, _: Any, size: int) -> tuple[Any, list[str]]:
    fnt = heldout.font(_MONO, size)
    words = lambda n: " ".join(_words(rng, 1).lower() for _ in range(n))  # noqa: E731
    lines = []
    for _ in range(rng.randint(3, 8)):
        r = rng.random()
        lines.append(f"user@box:~$ {words(1)} -{rng.choice('alrv')} {words(1)}.txt" if r < 0.3
                     else f"{rng.randint(1, 9999)} {words(2)} {rng.randint(0, 99)}%" if r < 0.6
                     else words(rng.randint(2, 5)))
    img = heldout.render_lines(rng, lines, fnt, "dark", "none", spacing=(1.15, 1.4),
                               margins=(10, 30))
    return img, lines


def pages(n: int, seed: int = heldout.SEED + 3) -> list[heldout.Sample]:
    """``n`` pages, the kinds in turn; font 14-24 px (the terminal: its mono face)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        kind = KINDS[i % len(KINDS)]
        face = _MONO if kind == "receipt" and rng.random() < 0.5 else \
            rng.choice(heldout.available_fonts())
        size = rng.randint(14, 24)
        img, lines = globals()[kind](rng, heldout.font(face, size), size)
        out.append(heldout.Sample(img, "\n".join(lines), kind,
                                  _MONO[0] if kind == "terminal" else face[0], size,
                                  "dark" if kind == "terminal" else "white", "none"))
    return out
