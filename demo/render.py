"""Synthetic printed text for the demo OCR model: lines and short pages, deterministic by seed.

A line is one row of text on a 28-px-high strip (one merged vision token high: patch 14 x
merge 2), its width rounded up to a multiple of 28 so the processor keeps the pixels as they
are. A page is a few such lines on a portrait canvas; its transcription joins the lines with
newlines. Fonts: Pillow's own default font (always there) and DejaVu Sans / Serif / Mono
when the machine has them. Light blur and noise; dark text on a light background.
"""
from __future__ import annotations

import os
import random
from functools import cache
from typing import Any

ROW = 28  # pixels per merged vision token (patch 14 x spatial merge 2)
CHARSET = ("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789"
           " .,;:!?'\"-()/&%$#+=@*")
_DEJAVU = ["DejaVuSans.ttf", "DejaVuSerif.ttf", "DejaVuSansMono.ttf"]
DEJAVU_DIR = "/usr/share/fonts/truetype/dejavu"  # Debian/Ubuntu's fonts-dejavu-core
_FONT_DIRS = [DEJAVU_DIR, "/usr/share/fonts/dejavu", "/usr/share/fonts/TTF"]
_WORDS = [
    "the", "of", "and", "to", "in", "is", "was", "that", "for", "it", "with", "as", "on", "be",
    "at", "by", "this", "had", "not", "are", "but", "from", "or", "have", "an", "they",
    "which", "one", "you", "were", "all", "we", "her", "she", "there", "would", "their",
    "will", "when", "who", "him", "been", "has", "more", "if", "no", "out", "so", "said",
    "what", "up", "its", "about", "into", "than", "them", "can", "only", "other", "new",
    "some", "could", "time", "these", "two", "may", "then", "do", "first", "any", "my", "now",
    "such", "like", "our", "over", "man", "me", "even", "most", "made", "after", "also", "did",
    "many", "before", "must", "through", "back", "years", "where", "much", "your", "way",
    "well", "down", "should", "because", "each", "just", "those", "people", "how", "too",
    "little", "state", "good", "very", "make", "world", "still", "own", "see", "men", "work",
    "long", "get", "here", "between", "both", "life", "being", "under", "never", "day", "same",
    "another", "know", "while", "last", "might", "us", "great", "old", "year", "off", "come",
    "since", "against", "go", "came", "right", "used", "take", "three", "page", "text",
    "model", "image", "reads", "invoice", "total", "date", "order", "number", "name", "street",
    "city", "paper", "letter", "table", "chart", "scan", "print", "line", "data", "file",
    "value", "price", "amount", "account", "report", "section", "figure", "note", "market",
    "water", "house", "school"]


@cache
def font_paths() -> tuple[str, ...]:
    """The DejaVu fonts present on this machine (none is fine: the default font suffices)."""
    found = []
    for name in _DEJAVU:
        for d in _FONT_DIRS:
            if os.path.exists(os.path.join(d, name)):
                found.append(os.path.join(d, name))
                break
    return tuple(found)


@cache
def _font(path: str | None, size: int) -> Any:
    from PIL import ImageFont

    return ImageFont.load_default(size=size) if path is None else ImageFont.truetype(path, size)


def pick_font(rng: random.Random, default_only: bool = False) -> Any:
    """Pillow's default font half the time (sizes 17-20), else a DejaVu face (16-18)."""
    paths = () if default_only else font_paths()
    if not paths or rng.random() < 0.5:
        return _font(None, rng.randint(17, 20))
    return _font(rng.choice(paths), rng.randint(16, 18))


def sample_text(rng: random.Random, max_chars: int) -> str:
    """A line of at most ``max_chars``: English-like words, numbers and random strings."""
    words: list[str] = []
    while True:
        r = rng.random()
        if r < 0.55:
            w = rng.choice(_WORDS)
            w = w.capitalize() if rng.random() < 0.2 else (w.upper() if rng.random() < 0.05 else w)
        elif r < 0.7:
            w = str(rng.randint(0, 10 ** rng.randint(1, 5)))
            if rng.random() < 0.3:
                w += rng.choice(".,%") + str(rng.randint(0, 99))
        else:
            w = "".join(rng.choice(CHARSET[:62] if rng.random() < 0.7 else CHARSET.strip())
                        for _ in range(rng.randint(1, 7)))
        if rng.random() < 0.15:
            w += rng.choice(".,;:!?")
        if rng.random() < 0.05:
            w = rng.choice(["(", "\"", "'"]) + w + rng.choice([")", "\"", "'"])
        cand = " ".join(words + [w])
        if len(cand) > max_chars:
            break
        words.append(w)
        if len(cand) >= rng.randint(1, max_chars):
            break
    text = " ".join(words).strip()
    return text or rng.choice(CHARSET[:62])


def _finish(img: Any, rng: random.Random) -> Any:
    """Light blur and noise, as a scan or a screenshot has them."""
    import numpy as np
    from PIL import Image, ImageFilter

    if rng.random() < 0.5:
        img = img.filter(ImageFilter.GaussianBlur(rng.uniform(0.2, 0.6)))
    if rng.random() < 0.5:
        a = np.asarray(img, dtype=np.float32)
        nrng = np.random.default_rng(rng.randrange(2 ** 32))
        a = a + nrng.normal(0, rng.uniform(1, 8), a.shape)
        img = Image.fromarray(a.clip(0, 255).astype(np.uint8))
    return img


def _colors(rng: random.Random) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    bg = rng.randint(215, 255)
    fg = rng.randint(0, 70)
    return (bg, bg, bg - rng.randint(0, 10)), (fg, fg, fg)


def _columns(text: str, font: Any, x: float, out: list[list[int]]) -> None:
    """Append each printed character of ``text`` drawn from ``x`` (its index in CHARSET) to
    the ``ROW``-px column its centre falls in: what each merged vision token shows, the
    training's per-token targets (demo/train.py)."""
    ends = [0.0] + [font.getlength(text[:i + 1]) for i in range(len(text))]
    for i, ch in enumerate(text):
        if ch != " " and ch in CHARSET:
            centre = x + (ends[i] + ends[i + 1]) / 2
            out[min(max(int(centre // ROW), 0), len(out) - 1)].append(CHARSET.index(ch))


def render_line(text: str, rng: random.Random, font: Any = None, *, clean: bool = False,
                columns: list[list[list[int]]] | None = None) -> Any:
    """``text`` on a strip ``ROW`` px high, width a multiple of ``ROW``. ``columns``: a list
    that receives one row of per-column characters (``_columns``)."""
    from PIL import Image, ImageDraw

    font = font or pick_font(rng)
    left, _, right, _ = font.getbbox(text)
    x0 = rng.randint(2, 10)
    width = -(-(right - min(left, 0) + x0 + rng.randint(2, 12)) // ROW) * ROW
    bg, fg = ((255, 255, 255), (0, 0, 0)) if clean else _colors(rng)
    img = Image.new("RGB", (width, ROW), bg)
    ascent, descent = font.getmetrics()
    y = (ROW - ascent - descent) // 2 + rng.randint(-1, 1)
    ImageDraw.Draw(img).text((x0 - min(left, 0), y), text, font=font, fill=fg)
    if columns is not None:
        columns.append([[] for _ in range(width // ROW)])
        _columns(text, font, x0 - min(left, 0), columns[-1])
    return img if clean else _finish(img, rng)


def render_page(lines: list[str], rng: random.Random, font: Any = None, *,
                width: int = 448, clean: bool = False, crop: bool = False,
                columns: list[list[list[int]]] | None = None) -> Any:
    """A few lines on a portrait canvas (``width`` x ~1.3 ``width``), top-left, one line per
    ``ROW``-aligned row with a gap row between paragraphs now and then. ``crop``: the
    canvas ends at a random row between the text's end and the full height (training:
    pages of several shapes, and fewer blank patches to pay for). ``columns``: a list
    that receives the page's rows of per-column characters (``_columns``)."""
    from PIL import Image, ImageDraw

    font = font or pick_font(rng)
    height = -(-int(width * 1.3) // ROW) * ROW
    bg, fg = ((255, 255, 255), (0, 0, 0)) if clean else _colors(rng)
    img = Image.new("RGB", (width, height), bg)
    draw = ImageDraw.Draw(img)
    ascent, descent = font.getmetrics()
    row = rng.randint(1, 3)
    x0 = rng.randint(14, 40)
    grid = [[[] for _ in range(width // ROW)] for _ in range(height // ROW)]
    for text in lines:
        y = row * ROW + (ROW - ascent - descent) // 2
        draw.text((x0 - min(font.getbbox(text)[0], 0), y), text, font=font, fill=fg)
        _columns(text, font, x0 - min(font.getbbox(text)[0], 0), grid[row])
        row += 1 + (rng.random() < 0.25)
    if crop:
        rows = rng.randint(min(row + 1, len(grid)), len(grid))
        img, grid = img.crop((0, 0, width, rows * ROW)), grid[:rows]
    if columns is not None:
        columns.extend(grid)
    return img if clean else _finish(img, rng)


def random_text(rng: random.Random, max_chars: int) -> str:
    """Random characters (no words, so no language prior to lean on: training's glyph
    teacher), ``max_chars // 3`` to ``max_chars`` of them."""
    n = rng.randint(max(1, max_chars // 3), max(1, max_chars))
    return "".join(rng.choice(CHARSET) for _ in range(n)).strip() or rng.choice(CHARSET[:62])


def sample_line(rng: random.Random, max_chars: int, *, default_only: bool = False,
                random_share: float = 0.0, columns: list[list[list[int]]] | None = None
                ) -> tuple[Any, str]:
    """(image, transcription) of one line; ``random_share`` of them random characters."""
    font = pick_font(rng, default_only)
    text = (random_text(rng, max_chars) if random_share and rng.random() < random_share
            else sample_text(rng, max_chars))
    while font.getbbox(text)[2] > 420 and len(text) > 1:  # keep lines under 448 px
        text = text[:-1].rstrip() or text[:1]
    return render_line(text, rng, font, columns=columns), text


def sample_page(rng: random.Random, *, n_lines: int | None = None, max_chars: int = 36,
                width: int = 448, default_only: bool = False, crop: bool = False,
                columns: list[list[list[int]]] | None = None) -> tuple[Any, str]:
    """(image, transcription) of a short page: 2-4 lines, joined by newlines."""
    font = pick_font(rng, default_only)
    lines = []
    for _ in range(n_lines or rng.randint(2, 4)):
        text = sample_text(rng, max_chars)
        while font.getbbox(text)[2] > width - 60 and len(text) > 1:
            text = text[:-1].rstrip() or text[:1]
        lines.append(text)
    return (render_page(lines, rng, font, width=width, crop=crop, columns=columns),
            "\n".join(lines))


def heldout_lines(n: int, seed: int = 12345, max_chars: int = 32) -> list[tuple[Any, str]]:
    """The evaluation set: ``n`` lines from a seed training never uses (training seeds its
    own generator with ``--seed``, 0 by default; evaluation and tests use 12345)."""
    rng = random.Random(seed)
    return [sample_line(rng, max_chars) for _ in range(n)]


def cer(hyp: str, ref: str) -> tuple[int, int]:
    """(edit distance, reference length): the character error rate's numerator and
    denominator, summed over a set before dividing."""
    prev = list(range(len(ref) + 1))
    for i, h in enumerate(hyp, 1):
        cur = [i]
        for j, r in enumerate(ref, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (h != r)))
        prev = cur
    return prev[-1], max(len(ref), 1)


def main(argv: list[str] | None = None) -> int:
    """``python -m triptych.demo.render OUT.png [LINE ...]``: an image to try the demo model on
    (README's first example): the given lines, or seeded sampled ones, printed like a
    screenshot in a face the training never prints (DejaVu Sans Bold, 24 px: demo/heldout.py's
    renderer, not this module's; Pillow's default font where DejaVu is missing)."""
    import argparse
    import sys

    from triptych.demo import heldout

    p = argparse.ArgumentParser(description=main.__doc__.splitlines()[0],
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("out", help="PNG file to write")
    p.add_argument("lines", nargs="*", help="lines of text (default: sampled ones)")
    p.add_argument("--lines-count", type=int, default=3, help="sampled lines when none given")
    p.add_argument("--font", default="DejaVuSans-Bold.ttf",
                   help="a DejaVu face's file name, or 'default' (Pillow's own font)")
    p.add_argument("--size", type=int, default=24, help="font size in pixels")
    p.add_argument("--background", choices=heldout.BACKGROUNDS, default="white",
                   help="dark: light text on a dark background")
    p.add_argument("--seed", type=int, default=7, help="seed of the sampled lines and margins")
    a = p.parse_args(argv)
    rng = random.Random(a.seed)
    face = None if a.font == "default" else a.font
    if face is not None and not os.path.exists(os.path.join(DEJAVU_DIR, face)):
        print(f"{face} not found in {DEJAVU_DIR}: Pillow's default font instead",
              file=sys.stderr)
        face = None
    lines = a.lines or [heldout.sample_text(rng, 28) for _ in range(a.lines_count)]
    img = heldout.render_lines(rng, lines, heldout.font((a.font, face), a.size), a.background,
                               "none", spacing=(1.3, 1.3), margins=(12, 24))
    img.save(a.out)
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
