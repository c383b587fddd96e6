"""Broad training lines for the demo model, read back through `triptych ocr`'s layout step.

Where demo/render.py prints a line straight onto a 28-px strip, this prints it as people's
images have it: 12-40 px, in one of ``FACES`` (DejaVu faces beside render.py's; the faces
of the held-out set, demo/heldout.py, are not among them), anywhere on a canvas with free
margins, on white, grey, dark (light text), textured or unevenly lit backgrounds, blurred,
noisy or JPEG-compressed; the text mixes render.py's words with random words in any case,
numbers with separators and random characters. The canvas then goes through the layout
step (demo/layout/) exactly as `triptych ocr --layout lines` sends it, and each strip is
a training sample with the characters its pieces hold: the model learns the strips it will
be shown, including the layout step's own slips of scale and position.
"""
from __future__ import annotations

import io
import os
import random
import string
from typing import Any

from triptych.demo import layout, render

_DIR = render.DEJAVU_DIR
FACES = ["DejaVuSans.ttf", "DejaVuSerif.ttf", "DejaVuSansMono.ttf", "DejaVuSerif-Bold.ttf",
         "DejaVuSansMono-Bold.ttf", "DejaVuSans-BoldOblique.ttf", "DejaVuSerif-BoldItalic.ttf",
         "DejaVuSansMono-Oblique.ttf", "DejaVuSansCondensed-Bold.ttf",
         "DejaVuSerifCondensed.ttf", "DejaVuSans-ExtraLight.ttf"]
# How training cuts its strips: the layout step's settings when the shipped phases 4-6 were
# trained (pieces up to 420 px, 6-px margin, word gaps from a quarter of the ink height),
# kept here so the recipe draws what it drew (and, likewise, no wide-gap cuts, no dot
# leaders taken out, every valley between two cores a line break, as then). The layout step
# has since cut shorter pieces (demo/layout/: read better on the dev set); the sequence
# phase trains on those (demo/sequences.py).
CUT = {"max_width": 420, "margin": 6, "word_gap": 0.25}


def faces() -> list[str | None]:
    """Pillow's default font (None) and the FACES this machine has."""
    return [None] + [os.path.join(_DIR, f) for f in FACES if os.path.exists(os.path.join(_DIR, f))]


def text(rng: random.Random, max_chars: int) -> str:
    """render.py's words half the time; else random words in any case, numbers with
    separators and punctuation around them."""
    if rng.random() < 0.5:
        return render.sample_text(rng, max_chars)
    out: list[str] = []
    while len(" ".join(out)) < rng.randint(1, max_chars):
        r = rng.random()
        if r < 0.6:
            w = "".join(rng.choice(string.ascii_lowercase) for _ in range(rng.randint(1, 10)))
            w = w.capitalize() if rng.random() < 0.3 else w.upper() if rng.random() < 0.1 else w
        elif r < 0.85:
            w = rng.choice(["", "$", "#", "+", "-", "("]) + "".join(
                rng.choice(string.digits + ".,-/:" if k % 3 == 2 else string.digits)
                for k in range(rng.randint(1, 10)))
        else:
            w = "".join(rng.choice(render.CHARSET.strip()) for _ in range(rng.randint(1, 4)))
        out.append(w + (rng.choice(".,;:!?%)\"'") if rng.random() < 0.15 else ""))
    line = " ".join(out)[:max_chars].strip()
    return line or rng.choice(string.ascii_letters)


def _canvas(rng: random.Random, w: int, h: int) -> tuple[Any, tuple[int, int, int]]:
    """(background, text colour): white, grey, dark, textured or unevenly lit."""
    import numpy as np
    from PIL import Image

    kind = rng.random()
    if kind < 0.15:  # light text on dark
        g = rng.randint(0, 90)
        return Image.new("RGB", (w, h), (g, g, g + rng.randint(0, 20))), \
            (rng.randint(170, 255),) * 3
    fg = (rng.randint(0, 80),) * 3
    if kind < 0.6:
        g = rng.randint(160, 255)
        return Image.new("RGB", (w, h), (g, g, max(0, g - rng.randint(0, 15)))), fg
    nrng = np.random.default_rng(rng.randrange(2 ** 32))
    cells = nrng.uniform(0, 1, (h // rng.randint(2, 8) + 2, w // rng.randint(2, 8) + 2))
    tex = np.asarray(Image.fromarray((cells * 255).astype(np.uint8)).resize(
        (w, h), Image.Resampling.BILINEAR), dtype=np.float32) / 255
    light = np.linspace(rng.uniform(-50, 0), rng.uniform(-50, 0), w)[None, :]
    base = rng.uniform(190, 235) + rng.uniform(10, 40) * tex + light
    return Image.fromarray(np.stack([base] * 3, -1).clip(0, 255).astype(np.uint8)), fg


def _degrade(rng: random.Random, img: Any) -> Any:
    import numpy as np
    from PIL import Image, ImageFilter

    if rng.random() < 0.3:
        img = img.filter(ImageFilter.GaussianBlur(rng.uniform(0.3, 1.3)))
    if rng.random() < 0.3:
        a = np.asarray(img, dtype=np.float32)
        a = a + np.random.default_rng(rng.randrange(2 ** 32)).normal(0, rng.uniform(2, 12), a.shape)
        img = Image.fromarray(a.clip(0, 255).astype(np.uint8))
    if rng.random() < 0.3:
        buf = io.BytesIO()
        img.save(buf, "JPEG", quality=rng.randint(20, 80))
        img = Image.open(io.BytesIO(buf.getvalue())).convert("RGB")
    return img


def sample(rng: random.Random, max_chars: int, columns: list[list[list[int]]] | None = None
           ) -> tuple[Any, str]:
    """(strip, transcription) of one line printed broadly and read back by the layout step
    (its first piece when the line is split); ``columns`` receives the strip's per-token
    characters (render._columns' targets). Lines the layout step misreads (not one line
    found) are drawn again."""
    from PIL import ImageDraw

    while True:
        path = rng.choice(faces())
        font = render._font(path, rng.randint(12, 40))
        line = text(rng, max_chars)
        left, _, right, _ = font.getbbox(line)
        asc, desc = font.getmetrics()
        x0, y0 = rng.randint(2, 40), rng.randint(2, 30)
        img, fg = _canvas(rng, x0 + right - min(left, 0) + rng.randint(2, 40),
                          y0 + asc + desc + rng.randint(2, 30))
        ImageDraw.Draw(img).text((x0 - min(left, 0), y0), line, font=font, fill=fg)
        norm = layout.normalise(_degrade(rng, img))
        found = layout.find_lines(norm, CUT["max_width"], CUT["word_gap"], wide_gap=None,
                                  leaders=False, touch=None)
        if len(found) != 1:
            continue
        (ln,) = found
        piece = ln.pieces[0]
        # Each character's centre, page pixels -> strip pixels, decides its piece and token.
        ends = [0.0] + [font.getlength(line[:i + 1]) for i in range(len(line))]
        centres = [x0 - min(left, 0) + (ends[i] + ends[i + 1]) / 2 for i in range(len(line))]
        keep = [i for i, c in enumerate(centres) if piece[0] <= c < piece[1] + 1]
        if not keep:
            continue
        ref = line[keep[0]:keep[-1] + 1].strip()
        strip = layout.strip(norm, ln, piece, CUT["margin"])
        if columns is not None:
            row: list[list[int]] = [[] for _ in range(strip.width // render.ROW)]
            for i in keep:
                if line[i] != " " and line[i] in render.CHARSET:
                    x = CUT["margin"] + (centres[i] - piece[0]) * ln.scale
                    row[min(max(int(x // render.ROW), 0), len(row) - 1)].append(
                        render.CHARSET.index(line[i]))
            columns.append(row)
        return strip, ref
