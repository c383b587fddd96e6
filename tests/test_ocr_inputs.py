"""`triptych ocr` reads untrusted inputs (issue 36, rows 5-7): a PDF page's pixels are worked
out from its size before it is rendered (--max-page-pixels), images open with the server's
decoders only, and a folder's symlinks stay inside it.
"""
from __future__ import annotations

import asyncio
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image
from triptych.jobs.ocr_sources import discover, load_image, pages
from triptych.jobs.pdf import (
    DocumentError,
    PageError,
    PageSize,
    Rasterizer,
    bitmap_size,
)

sys.path.insert(0, os.path.dirname(__file__))
from server_fixtures import img  # noqa: E402

TIMEOUT = 300  # seconds any one CLI run may take here


def blank_pdf(path: Path, *sizes: tuple[float, float]) -> Path:
    """A PDF written by hand: one empty page per (width, height) in points."""
    n = len(sizes)
    objs = [b"<< /Type /Catalog /Pages 2 0 R >>",
            b"<< /Type /Pages /Kids [%s] /Count %d >>"
            % (b" ".join(b"%d 0 R" % (3 + i) for i in range(n)), n)]
    objs += [b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 %g %g] >>" % s for s in sizes]
    out, offsets = bytearray(b"%PDF-1.4\n"), []
    for i, o in enumerate(objs, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % i + o + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objs) + 1)
    out += b"".join(b"%010d 00000 n \n" % o for o in offsets)
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objs) + 1,
                                                                            xref)
    path.write_bytes(bytes(out))
    return path


def ocr(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "triptych", "ocr", "--no-progress", *args],
                          capture_output=True, text=True, timeout=TIMEOUT)


# -- row 5: a page's pixels before rendering ---------------------------------------------------
RENDER = """
import resource, sys
resource.setrlimit(resource.RLIMIT_AS, (2 << 30, 2 << 30))  # the old 30,001 px render: 2.7 GB
from triptych.jobs.pdf import iter_pages
(page,) = iter_pages(sys.argv[1])
hwm = [x for x in open("/proc/self/status") if x.startswith("VmHWM")][0].split()[1]
print(page.width, page.height, *page.wanted, int(hwm) * 1024)
"""


def test_a_huge_pdf_page_is_never_rendered_at_full_size(tmp_path: Path) -> None:
    pdf = blank_pdf(tmp_path / "huge.pdf", (14400, 14400))
    assert len(pdf.read_bytes()) < 600  # the 553-byte PDF
    r = subprocess.run([sys.executable, "-c", RENDER, str(pdf)], capture_output=True,
                       text=True, timeout=TIMEOUT)
    assert r.returncode == 0, r.stderr[-3000:]
    w, h, wanted_w, wanted_h, peak = map(int, r.stdout.split())
    assert (wanted_w, wanted_h) == (30001, 30001)  # 150 dpi, as asked ...
    assert w == h and w * h <= 32_000_000 and w > 5000  # ... and as rendered
    assert peak < 1 << 30, peak  # (9.5 GB before)


def test_ocr_renders_a_huge_page_smaller_and_reads_the_others(tiny_qwen2_vl: str,
                                                              tmp_path: Path) -> None:
    pdf = blank_pdf(tmp_path / "doc.pdf", (14400, 14400), (100, 100), (-14400, -9000))
    r = ocr(str(pdf), "-o", str(tmp_path / "out"), "--format", "jsonl", "--dpi", "72",
            "--max-page-pixels", "40000", "--max-tokens", "2", "--model", tiny_qwen2_vl)
    assert r.returncode == 0, r.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "out" / "doc.pdf.jsonl").read_text().splitlines()]
    assert [x["error"] for x in rows] == [None, None, None]
    sizes = [(x["width"], x["height"]) for x in rows]
    assert sizes[0][0] == sizes[0][1] and 190 < sizes[0][0] and sizes[0][0] ** 2 <= 40000
    assert sizes[1] == (100, 100)  # (under the cap: as asked)
    assert sizes[2][0] * sizes[2][1] <= 40000 and sizes[2][0] > sizes[2][1] > 100
    assert "page 1: 14400 x 14400 px is above --max-page-pixels (40000)" in r.stderr
    assert "page 3: 14400 x 9000 px is above" in r.stderr


def test_page_size_fits_every_page_under_the_cap() -> None:
    size = PageSize(dpi=150)
    assert size.fit(612, 792) == (150 / 72, (1275, 1651), None)  # a letter page: as asked
    fitted = {(14400, 14400): (5656, 5656), (3e38, 3e38): (5656, 5656),
              (1e38, 5): (31_999_999, 1), (5, 1e38): (1, 31_999_999)}
    for (w, h), pixels in fitted.items():
        scale, got, wanted = size.fit(w, h)
        assert got == pixels == bitmap_size(w, h, scale), (w, h)
        assert wanted == bitmap_size(w, h, 150 / 72)
    for w, h in ((0, 10), (float("nan"), 10), (float("inf"), 10), (-1, 10)):
        with pytest.raises(PageError, match="no usable size"):
            size.fit(w, h)


def test_an_image_above_max_page_pixels_is_refused_before_decoding(tmp_path: Path) -> None:
    big = tmp_path / "big.png"
    Image.new("L", (6000, 6000)).save(big)  # 36 MP: under Pillow's own bomb guard
    with pytest.raises(DocumentError, match=r"6000 x 6000 px, above --max-page-pixels"):
        load_image(big, PageSize())
    small = tmp_path / "small.png"
    img(1, 100, 50).save(small)
    _, mime, w, h = load_image(small, PageSize(target_longest_dim=1000, max_pixels=20_000))
    assert mime == "image/png" and w * h <= 20_000 and abs(w / h - 2) < 0.05


# -- row 6: the server's image formats only ----------------------------------------------------
EPS = b"%!PS-Adobe-3.0 EPSF-3.0\n%%BoundingBox: 0 0 10 10\nnewpath 0 0 moveto showpage\n%%EOF\n"
OPEN = """
import sys
from pathlib import Path
from triptych.jobs.ocr_sources import load_image
from triptych.jobs.pdf import DocumentError, PageSize
try:
    load_image(Path(sys.argv[1]), PageSize())
except DocumentError as e:
    print(e)
"""


def test_an_eps_named_png_never_reaches_ghostscript(tmp_path: Path) -> None:
    import triptych.api.media.decode as server_decode
    import triptych.jobs.ocr_sources as ocr_sources

    (tmp_path / "bin").mkdir()
    gs = tmp_path / "bin" / "gs"  # a Ghostscript that leaves a mark when Pillow runs it
    gs.write_text(f"#!/bin/sh\ntouch {tmp_path / 'gs-ran'}\nexit 1\n")
    gs.chmod(0o755)
    (tmp_path / "page.png").write_bytes(EPS)
    r = subprocess.run([sys.executable, "-c", OPEN, str(tmp_path / "page.png")],
                       capture_output=True, text=True, timeout=TIMEOUT,
                       env={**os.environ, "PATH": f"{tmp_path / 'bin'}:{os.environ['PATH']}"})
    assert r.returncode == 0, r.stderr[-3000:]
    assert "not an image or a PDF" in r.stdout
    assert not (tmp_path / "gs-ran").exists()
    assert ocr_sources.IMAGE_FORMATS is server_decode.IMAGE_FORMATS  # one list, the server's


# -- row 7: symlinks out of an input folder ----------------------------------------------------
def test_symlinks_leading_out_of_a_folder_are_skipped_with_a_warning(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    outside, folder = tmp_path / "private", tmp_path / "scans"
    (outside / "dir").mkdir(parents=True)
    (folder / "sub").mkdir(parents=True)
    for p in (outside / "secret.png", outside / "dir" / "b.png", folder / "a.png",
              folder / "sub" / "c.png"):
        img(2).save(p)
    (folder / "out.png").symlink_to(outside / "secret.png")
    (folder / "sub" / "up.png").symlink_to(Path("..") / ".." / "private" / "secret.png")
    (folder / "outdir").symlink_to(outside / "dir")
    (folder / "loop.png").symlink_to(folder / "loop.png")
    (folder / "alias.png").symlink_to(folder / "sub" / "c.png")  # inside: read
    (folder / "subalias").symlink_to(folder / "sub")  # inside: its files are found as sub/
    with caplog.at_level(logging.WARNING, logger="triptych.jobs"):
        docs = discover([str(folder)])
    assert [d.name for d in docs] == ["scans/a.png", "scans/alias.png", "scans/sub/c.png"]
    warned = " ".join(r.getMessage() for r in caplog.records)
    for name in ("out.png", "up.png", "outdir", "loop.png"):
        assert f"{name}: a symlink" in warned, name
    assert str(outside / "secret.png") in warned and "subalias" not in warned

    # A file swapped for such a symlink after the folder was searched is not read either.
    (folder / "a.png").unlink()
    (folder / "a.png").symlink_to(outside / "secret.png")

    async def first_job():
        raster = Rasterizer()
        try:
            async for job in pages(docs[:1], raster, PageSize()):
                return job
        finally:
            raster.close()

    job = asyncio.run(first_job())
    assert job.number == 0 and job.image is None and "outside" in job.error


# -- issue 42, row 8: a PDF swapped for an outside one while it is being read -----------------
def test_a_pdf_swapped_mid_job_is_read_from_the_file_first_opened(tmp_path: Path) -> None:
    """`triptych ocr` on a folder: after its first page, the PDF is replaced by a symlink
    to an outside PDF. PDFium is reopened every REOPEN_EVERY pages; every page still comes
    from the file opened at the check (its descriptor), never from the path again."""
    from triptych.jobs.pdf import REOPEN_EVERY

    folder, outside = tmp_path / "in", tmp_path / "private"
    folder.mkdir()
    outside.mkdir()
    pages_in = REOPEN_EVERY + 8  # past a reopening
    blank_pdf(folder / "doc.pdf", *[(72.0, 144.0)] * pages_in)  # tall pages: 150 x 300 px
    blank_pdf(outside / "secret.pdf", *[(144.0, 72.0)] * pages_in)  # wide: 300 x 150 px
    docs = discover([str(folder)])

    async def read_all() -> list:
        raster, got = Rasterizer(), []
        try:
            async for job in pages(docs, raster, PageSize()):
                got.append(job)
                if len(got) == 1:  # the job has started: swap the file for a symlink
                    (folder / "doc.pdf").rename(tmp_path / "moved.pdf")
                    (folder / "doc.pdf").symlink_to(outside / "secret.pdf")
        finally:
            raster.close()
        return got

    got = asyncio.run(read_all())
    assert [j.number for j in got] == list(range(1, pages_in + 1))
    assert all(j.error is None and (j.width, j.height) == (150, 300) for j in got), \
        [(j.number, j.width, j.height, j.error) for j in got if (j.width, j.height) != (150, 300)]
