"""The layout step of `triptych ocr --layout lines` (jobs/layout.py, jobs/ocr_lines.py):
synthetic pages whose line boxes are known (each line's ink drawn alone) come back as those
lines, top to bottom, whatever the background (white, grey, textured, light on dark), the
spacing (uneven, touching lines) or the size; each strip is in the geometry the model reads;
a page's strips are read in order and joined, and a failed strip fails the page."""
from __future__ import annotations

import asyncio
import io
import random

import numpy as np
import pytest
from PIL import Image, ImageDraw
from triptych.demo import heldout, layout
from triptych.jobs.ocr_lines import page_strips, reads_lines, transcribe_lines
from triptych.jobs.ocr_output import PageResult

TEXTS = ["Invoice 2041, total $318.40", "quick brown foxes jump", "Lily Hill: 12 (ok)",
         "gypsy jig, quay", "THE END 99"]


def page(texts: list[str], size: int, gaps: list[int], *, bg: str = "white", width: int = 700,
         fnt: tuple[str, str | None] = ("DejaVu Sans", "DejaVuSans.ttf"), seed: int = 0
         ) -> tuple[Image.Image, list[tuple[int, int, int, int]]]:
    """``texts`` printed at ``size`` px, line i below line i-1 by its line height plus
    ``gaps[i]`` px (negative: overlapping line boxes); the page and each line's ink box
    (left, top, right, bottom), measured by drawing the line alone."""
    f = heldout.font(fnt, size)
    asc, desc = f.getmetrics()
    ys, y = [], 30
    for g in gaps:
        y += g
        ys.append(y)
        y += asc + desc
    rng = random.Random(seed)
    img, fg = heldout._background(rng, bg, width, y + 30)
    boxes = []
    for t, y in zip(texts, ys):
        alone = Image.new("L", img.size, 0)
        ImageDraw.Draw(alone).text((25, y), t, font=f, fill=255)
        boxes.append(alone.getbbox())
        ImageDraw.Draw(img).text((25, y), t, font=f, fill=fg)
    return img, boxes


def found(img: Image.Image) -> list[layout.Line]:
    return layout.find_lines(layout.normalise(img))


def assert_boxes(lines: list[layout.Line], boxes: list[tuple[int, int, int, int]],
                 tol: int = 2) -> None:
    assert len(lines) == len(boxes), (lines, boxes)
    for ln, (left, top, right, bottom) in zip(lines, boxes):
        assert abs(ln.ink_top - top) <= tol and abs(ln.left - left) <= tol, (ln, top, left)
        assert abs(ln.right - right) <= tol, (ln, right)
        assert ln.top <= top + tol and ln.bottom >= bottom - tol, (ln, top, bottom)
        assert ln.ink_top < ln.baseline <= bottom


@pytest.mark.parametrize("bg", ["white", "grey", "dark", "textured"])
@pytest.mark.parametrize("size", [14, 22, 32])
def test_lines_found_on_every_background_and_size(bg: str, size: int) -> None:
    img, boxes = page(TEXTS, size, [0, 4, 30, 9, 60], bg=bg)
    assert_boxes(found(img), boxes)


def test_touching_lines_are_split_between_their_cores() -> None:
    # Line boxes overlap: the descenders of one line reach below the capitals of the next.
    img, boxes = page(["Total due by May, 2041", "Hill Lily THE Bold"], 24, [0, -7])
    assert boxes[0][3] > boxes[1][1]
    lines = found(img)
    assert len(lines) == 2
    assert lines[0].bottom == lines[1].top  # one cut, no row lost or shared
    assert abs(lines[1].ink_top - boxes[1][1]) <= 3


def test_dots_and_accents_join_their_line() -> None:
    # The dots of i and j stand 3-4 px above their stems at 32 px: rows apart from the line.
    img, boxes = page(["iii jij iii", "minimum"], 32, [0, 20], fnt=("default", None))
    lines = found(img)
    assert len(lines) == 2 and lines[0].ink_top <= boxes[0][1] + 1


def test_blank_and_flat_pages_have_no_lines() -> None:
    assert found(Image.new("RGB", (300, 200), (240, 240, 240))) == []
    noise = np.random.default_rng(0).normal(200, 3, (200, 300)).clip(0, 255).astype(np.uint8)
    assert found(Image.fromarray(noise).convert("RGB")) == []
    assert layout.line_strips(Image.new("RGB", (50, 40), (0, 0, 0))) == []


def test_strips_have_the_training_geometry() -> None:
    img, _ = page(TEXTS, 30, [0, 10, 10, 10, 10], bg="dark")
    norm = layout.normalise(img)
    for ln in layout.find_lines(norm):
        s = np.asarray(layout.strip(norm, ln, ln.pieces[0]).convert("L"))
        assert s.shape[0] == layout.LINE_HEIGHT and s.shape[1] % layout.LINE_HEIGHT == 0
        rows = np.nonzero((s < 128).any(axis=1))[0]
        cols = np.nonzero((s < 128).any(axis=0))[0]
        assert abs(rows[0] - layout.TOP) <= 1  # capitals and ascenders from row TOP
        assert abs(cols[0] - layout.MARGIN) <= 1
        assert s.min() == 0 and np.median(s) > 240  # dark text on white, light-on-dark inverted


def test_a_long_line_is_split_at_word_gaps() -> None:
    words = " ".join(["building"] * 14)
    img, _ = page([words], 20, [0], width=1500)
    (ln,) = found(img)
    assert len(ln.pieces) >= 2
    assert all((b - a) * ln.scale <= layout.MAX_WIDTH + 1 for a, b in ln.pieces)
    gaps = [b0 - a1 for (_, a1), (b0, _) in zip(ln.pieces, ln.pieces[1:])]
    assert all(g >= (ln.baseline - ln.ink_top) / 4 for g in gaps)  # word gaps, not letters


def test_page_strips_round_trip_and_reads_lines_rule() -> None:
    img, _ = page(TEXTS[2:], 18, [0, 10, 50])  # lines short enough for one strip each
    buf = io.BytesIO()
    img.save(buf, format="JPEG", quality=60)
    strips = page_strips(buf.getvalue())
    assert [len(r) for r in strips] == [1, 1, 1]
    assert all(Image.open(io.BytesIO(p)).height == layout.LINE_HEIGHT for r in strips for p in r)
    assert reads_lines("auto", "ocr_demo") and reads_lines("lines", "Qwen2-VL")
    assert not reads_lines("auto", "Qwen2-VL") and not reads_lines("page", "ocr_demo")


def test_a_page_is_read_line_by_line_in_order() -> None:
    img, _ = page(["first line here", "second one", "third and last"], 20, [0, 25, 8])
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    index = {p: i for i, (p,) in enumerate(page_strips(buf.getvalue()))}
    assert len(index) == 3

    async def read(png: bytes) -> PageResult:
        await asyncio.sleep(0.01 * (3 - index[png]))  # later lines answer first
        return PageResult(f"L{index[png]}", None, 10, 2, "stop", 1)

    async def run() -> PageResult:
        return await transcribe_lines(buf.getvalue(), read, asyncio.Semaphore(2))

    r = asyncio.run(run())
    assert (r.text, r.error, r.prompt_tokens, r.completion_tokens, r.finish_reason) == (
        "L0\nL1\nL2", None, 30, 6, "stop")

    async def fail(png: bytes) -> PageResult:
        return PageResult(error="HTTP 500: busy", attempts=4)

    r = asyncio.run(transcribe_lines(buf.getvalue(), fail, asyncio.Semaphore(2)))
    assert r.error == "HTTP 500: busy" and r.attempts == 4
    blank = io.BytesIO()
    Image.new("RGB", (200, 100), "white").save(blank, format="PNG")
    r = asyncio.run(transcribe_lines(blank.getvalue(), fail, asyncio.Semaphore(2)))
    assert (r.text, r.error) == ("", None)


# -- whole pages: skew, columns, rules and tables, receipts (layout.read_page) ------------------
WORDS = ["above", "budget", "camera", "decide", "energy", "family", "garden", "central",
         "finish", "choice", "market", "doctor", "evening", "friend", "college"]


def face(name: str, size: int):
    return heldout.font((name, name), size)


def text_page(lines: list[str], size: int = 18, width: int = 600, x: int = 30):
    f = face("DejaVuSans.ttf", size)
    img = Image.new("RGB", (width, 40 + len(lines) * int(size * 1.6)), "white")
    for i, t in enumerate(lines):
        ImageDraw.Draw(img).text((x, 20 + i * int(size * 1.6)), t, font=f, fill=0)
    return img


def some_words(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


@pytest.mark.parametrize("angle", [-4.5, -2.0, 1.0, 3.0])
def test_a_turned_scan_is_set_level_and_read_line_by_line(angle: float) -> None:
    rng = random.Random(1)
    lines = [some_words(rng, 6) for _ in range(8)]
    straight = text_page(lines)
    turned = straight.rotate(-angle, resample=Image.Resampling.BICUBIC, expand=True,
                             fillcolor="white")  # PIL turns anticlockwise: lines fall right
    page = layout.read_page(turned)
    assert abs(page.angle - angle) <= 0.15, page.angle
    assert len(page.lines) == len(lines)
    assert [len(ln.pieces) for ln in page.lines] == [len(ln.pieces) for ln in
                                                     layout.read_page(straight).lines]


def test_a_level_page_is_not_turned() -> None:
    img = text_page([some_words(random.Random(2), 5) for _ in range(4)])
    page = layout.read_page(img)
    assert page.angle == 0.0 and np.array_equal(page.norm, layout.normalise(img))


def test_two_columns_are_read_one_after_the_other() -> None:
    rng = random.Random(3)
    f, title = face("DejaVuSerif.ttf", 16), face("DejaVuSans-Bold.ttf", 24)
    img = Image.new("RGB", (700, 340), "white")
    d = ImageDraw.Draw(img)
    d.text((20, 10), "A title across both", font=title, fill=0)
    for i in range(10):  # the columns' lines side by side, on the same rows
        d.text((20, 60 + 24 * i), some_words(rng, 4), font=f, fill=0)
        d.text((370, 60 + 24 * i), some_words(rng, 4), font=f, fill=0)
    lines = layout.read_page(img).lines
    assert len(lines) == 21
    assert all(ln.right < 360 for ln in lines[1:11]) and all(ln.left > 360 for ln in lines[11:])
    assert [ln.ink_top for ln in lines[1:11]] == sorted(ln.ink_top for ln in lines[1:11])


def receipt(leaders: bool) -> tuple[Image.Image, list[tuple[int, int]]]:
    """Six items with their prices set flush right (after dot leaders or spaces: item, gap
    and price narrower than one piece), a rule below; and each line's (item end, price
    start) in pixels."""
    rng, f, right = random.Random(4), face("DejaVuSansMono.ttf", 18), 230
    img = Image.new("RGB", (260, 220), "white")
    d, ends = ImageDraw.Draw(img), []
    for i in range(6):
        item, price, y = some_words(rng, 1), f"{rng.randint(1, 99)}.{rng.randint(0, 99):02d}", \
            20 + 26 * i
        d.text((20, y), item, font=f, fill=0)
        d.text((right - f.getlength(price), y), price, font=f, fill=0)
        x = 20 + f.getlength(item) + 10
        while leaders and x < right - f.getlength(price) - 14:
            d.text((x, y), ".", font=f, fill=0)
            x += 11
        ends.append((int(20 + f.getlength(item)), int(right - f.getlength(price))))
    d.line((20, 180, right, 180), fill=0, width=2)
    return img, ends


@pytest.mark.parametrize("leaders", [False, True])
def test_a_receipt_reads_item_then_price_with_the_gap_between(leaders: bool) -> None:
    img, ends = receipt(leaders)
    lines = layout.read_page(img).lines
    assert len(lines) == 6  # the rule below is no line
    for ln, (item_end, price_start) in zip(lines, ends):
        (_, a1), (b0, _) = ln.pieces  # the item, then the price: nothing between
        assert a1 <= item_end + 2 and b0 >= price_start - 2, (ln.pieces, item_end, price_start)


def test_a_table_with_a_grid_reads_row_by_row_without_its_rules() -> None:
    rng, f = random.Random(5), face("DejaVuSans.ttf", 17)
    img = Image.new("RGB", (520, 200), "white")
    d, xs = ImageDraw.Draw(img), [10, 180, 300, 510]
    for r in range(5):
        for c, cell in enumerate([rng.choice(WORDS), str(rng.randint(1, 999)), "$1.25"]):
            d.text((xs[c] + 8, 14 + 36 * r), cell, font=f, fill=0)
    for r in range(6):
        d.line((10, 8 + 36 * r, 510, 8 + 36 * r), fill=0, width=1)
    for x in xs:
        d.line((x, 8, x, 188), fill=0, width=1)
    page = layout.read_page(img)
    assert [len(ln.pieces) for ln in page.lines] == [3] * 5
    assert all(xs[c] < p[0] < p[1] < xs[c + 1] for ln in page.lines
               for c, p in enumerate(ln.pieces))
    assert page.norm[8:189, xs].min() > 0.9  # the grid is background now


def test_a_short_item_before_long_dot_leaders_stays_one_line() -> None:
    """The leaders' row of dots on the baseline outweighs the few letters above it: a core
    of its own, but no touching line (the rows between hold letters, not a few strokes)."""
    img = Image.new("RGB", (460, 60), "white")
    ImageDraw.Draw(img).text((20, 20), "Tax " + "." * 30 + " 1.12",
                             font=face("DejaVuSans.ttf", 18), fill=0)
    (line,) = layout.read_page(img).lines
    assert len(line.pieces) == 2
