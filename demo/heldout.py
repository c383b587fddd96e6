"""The held-out evaluation set of the demo model: what a newcomer shows it, drawn with a seed
and renderer settings that training never uses (docs/demo-model.md, "Held-out evaluation").

Training (demo/render.py) prints words of its own list, numbers and random strings in
Pillow's default font (17-20 px) or DejaVu Sans / Serif / Mono (16-18 px), dark on light,
on 28-px strips. This set prints text of another kind (``sample_text``: another word list,
prices, dates, codes, mixed case and punctuation) at 14-32 px in any of ``FONTS`` (faces
training never saw among them), placed anywhere on canvases of any size, on white, grey,
dark (light text) and textured backgrounds, blurred or JPEG-compressed now and then; as
single lines, as screenshots of 2-4 lines, and as pages of multi-page PDFs. Every sample
carries the condition it was drawn under, so the CER can be reported per condition.

Seeds: the held-out set is ``SEED``; layout and recipe choices are tuned on ``DEV_SEED``
only. Neither is a training seed (those are small integers, ``--seed``)."""
from __future__ import annotations

import io
import os
import random
from dataclasses import dataclass
from typing import Any

SEED, DEV_SEED = 35_0001, 35_0002
_DIR = "/usr/share/fonts/truetype/dejavu"  # render.DEJAVU_DIR (render imports this module)
# (name, file or None for Pillow's default font); the starred faces are never used in
# training (demo/render.py, demo/augment.py).
FONTS = [("default", None), ("DejaVu Sans", "DejaVuSans.ttf"),
         ("DejaVu Serif", "DejaVuSerif.ttf"), ("DejaVu Sans Mono", "DejaVuSansMono.ttf"),
         ("*Sans Bold", "DejaVuSans-Bold.ttf"), ("*Sans Condensed", "DejaVuSansCondensed.ttf"),
         ("*Sans Oblique", "DejaVuSans-Oblique.ttf"), ("*Serif Italic", "DejaVuSerif-Italic.ttf")]
BACKGROUNDS = ["white", "grey", "dark", "textured"]
_WORDS = [  # common English words, none of them in training's list (render._WORDS)
    "above", "across", "action", "actually", "ago", "agree", "almost", "alone", "along",
    "already", "although", "always", "among", "animal", "answer", "anyone", "anything",
    "appear", "apply", "area", "arm", "around", "arrive", "art", "article", "artist",
    "ask", "attack", "author", "available", "avoid", "away", "baby", "bad", "bag", "ball",
    "bank", "bar", "base", "beat", "beautiful", "bed", "behind", "believe", "best",
    "better", "beyond", "big", "bill", "bit", "black", "blood", "blue", "board", "body",
    "book", "born", "box", "boy", "break", "bring", "brother", "budget", "build",
    "building", "business", "buy", "call", "camera", "campaign", "cancer", "car", "card",
    "care", "career", "carry", "case", "catch", "cause", "cell", "center", "central",
    "century", "certain", "chair", "challenge", "chance", "change", "character", "charge",
    "check", "child", "choice", "choose", "church", "citizen", "civil", "claim", "class",
    "clear", "close", "coach", "cold", "collection", "college", "color", "common",
    "company", "compare", "computer", "concern", "condition", "conference", "congress",
    "consider", "contain", "continue", "control", "cost", "country", "couple", "course",
    "court", "cover", "create", "crime", "cultural", "cup", "current", "customer", "cut",
    "dark", "daughter", "dead", "deal", "death", "debate", "decade", "decide", "deep",
    "defense", "degree", "democrat", "describe", "design", "despite", "detail",
    "determine", "develop", "difference", "dinner", "direction", "discover", "discuss",
    "disease", "doctor", "dog", "door", "draw", "dream", "drive", "drop", "drug", "during",
    "early", "east", "easy", "economy", "edge", "education", "effect", "effort", "eight",
    "either", "election", "employee", "energy", "enjoy", "enough", "enter", "entire",
    "environment", "evening", "event", "evidence", "exactly", "example", "executive",
    "exist", "expect", "expert", "explain", "face", "fact", "factor", "fail", "fall",
    "family", "far", "fast", "father", "fear", "federal", "feel", "field", "fight", "fill",
    "film", "final", "finally", "finance", "find", "fine", "finger", "finish", "fire",
    "firm", "fish", "five", "floor", "fly", "focus", "follow", "food", "foot", "force",
    "foreign", "forget", "form", "former", "forward", "four", "free", "friend", "front",
    "full", "fund", "future", "game", "garden", "gas", "general"]


@dataclass
class Sample:
    """One held-out image, its transcription (lines joined by newlines) and its condition."""

    image: Any  # PIL image (a page of a PDF for kind "pdf")
    text: str
    kind: str  # "line", "screenshot" or "pdf"
    font: str
    size: int  # font size, px
    background: str
    noise: str  # "none", "blur" or "jpeg"
    doc: int = 0  # the PDF it belongs to (kind "pdf")


def sample_text(rng: random.Random, max_chars: int) -> str:
    """A line of held-out text: words of another list than training's, any case, with
    prices, dates, codes, numbers and punctuation; at most ``max_chars`` characters."""
    out: list[str] = []
    while True:
        r = rng.random()
        if r < 0.6:
            w = rng.choice(_WORDS)
            w = w.capitalize() if rng.random() < 0.3 else w.upper() if rng.random() < 0.1 else w
        elif r < 0.7:
            w = f"${rng.randint(1, 9999)}.{rng.randint(0, 99):02d}"
        elif r < 0.77:
            w = f"{rng.randint(2000, 2030)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"
        elif r < 0.85:
            w = rng.choice(["INV", "REF", "No.", "#", "ID", "Tel"]) + rng.choice(["", "-", " "]) \
                + str(rng.randint(10, 99999))
        elif r < 0.93:
            w = str(rng.randint(0, 10 ** rng.randint(1, 4)))
        else:
            w = rng.choice(["(see below)", "e.g.", "i.e.", "&", "@home", "100%", "x=2+3",
                            "\"quoted\"", "it's", "A/B", "Q&A", "p. 12", "*", "Re:"])
        if rng.random() < 0.15:
            w += rng.choice(".,;:!?")
        cand = " ".join(out + [w])
        if len(cand) > max_chars:
            break
        out.append(w)
        if len(cand) >= rng.randint(max_chars // 3, max_chars):
            break
    return " ".join(out) or rng.choice(_WORDS)


def font(name_file: tuple[str, str | None], size: int) -> Any:
    from PIL import ImageFont

    _, f = name_file
    return ImageFont.load_default(size=size) if f is None else \
        ImageFont.truetype(os.path.join(_DIR, f), size)


def available_fonts() -> list[tuple[str, str | None]]:
    """FONTS present on this machine (Pillow's default font always is)."""
    return [f for f in FONTS if f[1] is None or os.path.exists(os.path.join(_DIR, f[1]))]


def _background(rng: random.Random, kind: str, w: int, h: int) -> tuple[Any, tuple]:
    """(canvas, text colour) for a background kind."""
    import numpy as np
    from PIL import Image, ImageFilter

    if kind == "white":
        return Image.new("RGB", (w, h), (255, 255, 255)), (rng.randint(0, 40),) * 3
    if kind == "grey":
        g = rng.randint(170, 215)
        return Image.new("RGB", (w, h), (g, g, g + rng.randint(-8, 8))), (rng.randint(0, 40),) * 3
    if kind == "dark":
        g = rng.randint(10, 70)
        return Image.new("RGB", (w, h), (g, g, g + 10)), (rng.randint(200, 255),) * 3
    a = np.random.default_rng(rng.randrange(2 ** 32)).normal(0, 1, (h // 4 + 2, w // 4 + 2))
    tex = Image.fromarray(((a - a.min()) / (np.ptp(a) + 1e-6) * 255).astype(np.uint8))
    tex = tex.resize((w, h), Image.Resampling.BICUBIC).filter(ImageFilter.GaussianBlur(1.5))
    t = np.asarray(tex, dtype=np.float32) / 255
    ramp = np.linspace(0, rng.uniform(-40, 40), w)[None, :]
    base = 205 + 45 * t + ramp
    img = np.stack([base, base * rng.uniform(0.93, 1.0), base * rng.uniform(0.88, 1.0)], -1)
    return Image.fromarray(img.clip(0, 255).astype(np.uint8)), (rng.randint(0, 50),) * 3


def _degrade(rng: random.Random, img: Any, noise: str) -> Any:
    from PIL import Image, ImageFilter

    if noise == "blur":
        return img.filter(ImageFilter.GaussianBlur(rng.uniform(0.6, 1.2)))
    if noise == "jpeg":
        buf = io.BytesIO()
        img.save(buf, "JPEG", quality=rng.randint(25, 60))
        return Image.open(io.BytesIO(buf.getvalue())).convert("RGB")
    return img


def render_lines(rng: random.Random, lines: list[str], fnt: Any, background: str,
                 noise: str, *, width: int | None = None, spacing: tuple[float, float]
                 = (1.0, 1.0), margins: tuple[int, int] = (4, 40)) -> Any:
    """``lines`` printed top to bottom on a canvas of their own, with free margins and
    line spacing (a factor of the font's line height per gap)."""
    from PIL import ImageDraw

    asc, desc = fnt.getmetrics()
    left, top = rng.randint(*margins), rng.randint(*margins)
    widest = max(fnt.getbbox(t)[2] for t in lines)
    w = max(width or 0, left + widest + rng.randint(*margins))
    ys, y = [], top
    for _ in lines:
        ys.append(y)
        y += int((asc + desc) * rng.uniform(*spacing))
    h = ys[-1] + asc + desc + rng.randint(*margins)
    img, fg = _background(rng, background, w, h)
    draw = ImageDraw.Draw(img)
    for t, y in zip(lines, ys):
        draw.text((left, y), t, font=fnt, fill=fg)
    return _degrade(rng, img, noise)


def _condition(rng: random.Random) -> tuple[tuple[str, str | None], int, str, str]:
    fonts = available_fonts()
    return (rng.choice(fonts), rng.randint(14, 32), rng.choice(BACKGROUNDS),
            rng.choice(["none", "none", "blur", "jpeg"]))


def lines(n: int, seed: int = SEED) -> list[Sample]:
    """``n`` single lines (up to 40 characters), one image each."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        f, size, bg, noise = _condition(rng)
        text = sample_text(rng, 40)
        img = render_lines(rng, [text], font(f, size), bg, noise)
        out.append(Sample(img, text, "line", f[0], size, bg, noise))
    return out


def screenshots(n: int, seed: int = SEED + 1) -> list[Sample]:
    """``n`` screenshots: 2-4 lines at 14-28 px, free spacing, 400-900 px wide."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        f, _, bg, noise = _condition(rng)
        size = rng.randint(14, 28)
        text = [sample_text(rng, 40) for _ in range(rng.randint(2, 4))]
        img = render_lines(rng, text, font(f, size), bg, noise, width=rng.randint(400, 900),
                           spacing=(1.05, 2.2), margins=(8, 60))
        out.append(Sample(img, "\n".join(text), "screenshot", f[0], size, bg, noise))
    return out


def pdf_pages(n_docs: int, seed: int = SEED + 2) -> list[Sample]:
    """Pages of ``n_docs`` documents (2-3 pages of 3-6 lines each, 14-24 px, white or
    grey paper), to be saved as multi-page PDFs (``save_pdfs``)."""
    rng = random.Random(seed)
    out = []
    for d in range(n_docs):
        f = rng.choice(available_fonts())
        size = rng.randint(14, 24)
        bg = rng.choice(["white", "white", "grey"])
        for _ in range(rng.randint(2, 3)):
            text = [sample_text(rng, 40) for _ in range(rng.randint(3, 6))]
            img = render_lines(rng, text, font(f, size), bg, "none", width=rng.randint(500, 700),
                               spacing=(1.1, 1.8), margins=(30, 80))
            out.append(Sample(img, "\n".join(text), "pdf", f[0], size, bg, "none", d))
    return out


def save_pdfs(pages: list[Sample], folder: str) -> list[str]:
    """Each document's pages as one PDF (72 dpi: a page image's pixels are its points)."""
    paths = []
    for d in sorted({p.doc for p in pages}):
        imgs = [p.image for p in pages if p.doc == d]
        path = os.path.join(folder, f"doc-{d:02d}.pdf")
        imgs[0].save(path, "PDF", save_all=True, append_images=imgs[1:], resolution=72.0)
        paths.append(path)
    return paths
