"""`triptych ocr`: images, folders and PDFs page by page, in-process or --server.

The tiny checkpoint has random weights: transcriptions are gibberish, so the tests check
order (a PDF's page i answers as the same page sent as an image file does), counts,
formats, failures per document, resume, and that rasterizing keeps memory flat.
"""
from __future__ import annotations

import asyncio
import gc
import json
import os
import subprocess
import sys
from argparse import Namespace
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageDraw
from triptych.jobs.backend import Reply
from triptych.jobs.ocr import transcribe
from triptych.jobs.ocr_sources import PageJob
from triptych.jobs.pdf import iter_pages

sys.path.insert(0, os.path.dirname(__file__))
from server_fixtures import module_server  # noqa: E402

TIMEOUT = 300
DIM = "64"  # --target-longest-dim: a few image tokens per page keep the tiny model quick
PAGES = 4


def page_image(i: int, size: tuple[int, int] = (120, 160)) -> Image.Image:
    """A page: a line of rendered text over a pattern of its own (pages differ)."""
    rng = np.random.default_rng(100 + i)
    im = Image.fromarray(rng.integers(0, 256, (size[1], size[0], 3), dtype=np.uint8))
    ImageDraw.Draw(im).text((8, 8), f"Page {i + 1}: the quick brown fox", fill="black")
    return im


def write_pdf(path: Path, images: list[Image.Image], resolution: float = 72.0) -> Path:
    images[0].save(path, "PDF", save_all=True, append_images=images[1:], resolution=resolution)
    return path


def encrypted_pdf() -> bytes:
    """A one-page PDF under the standard security handler with a user password we do not
    know (PDFium asks for it: the document cannot be read)."""
    objs = [b"<< /Type /Catalog /Pages 2 0 R >>", b"<< /Type /Pages /Kids [3 0 R] /Count 1 >>",
            b"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 200 200] >>",
            b"<< /Filter /Standard /V 1 /R 2 /O <" + b"11" * 32 + b"> /U <" + b"22" * 32
            + b"> /P -4 >>"]
    out, offsets = bytearray(b"%PDF-1.4\n"), []
    for i, o in enumerate(objs, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % i + o + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objs) + 1)
    out += b"".join(b"%010d 00000 n \n" % o for o in offsets)
    file_id = b"<00112233445566778899aabbccddeeff>"
    out += (b"trailer\n<< /Size %d /Root 1 0 R /Encrypt 4 0 R /ID [%s %s] >>\nstartxref\n"
            b"%d\n%%%%EOF\n" % (len(objs) + 1, file_id, file_id, xref))
    return bytes(out)


def ocr(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "triptych", "ocr", "--no-progress",
                           "--target-longest-dim", DIM, "--max-tokens", "6", *args],
                          capture_output=True, text=True, timeout=TIMEOUT)


def jsonl(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("ocr-in")
    pdf = write_pdf(d / "report.pdf", [page_image(i) for i in range(PAGES)])
    # The same pages as image files, rendered exactly as the job renders the PDF's pages.
    (d / "pages" / "deeper").mkdir(parents=True)
    for i, page in enumerate(iter_pages(str(pdf), target_longest_dim=int(DIM))):
        sub = "deeper/" if i % 2 else ""
        (d / "pages" / f"{sub}page-{i + 1}.png").write_bytes(page.png)
    (d / "pages" / "notes.txt").write_text("not picked up: folders take images and PDFs")
    (d / "corrupt.pdf").write_bytes(b"%PDF-1.4\nthis is not a PDF body\n%%EOF\n")
    (d / "locked.pdf").write_bytes(encrypted_pdf())
    (d / "fake.png").write_bytes(b"plain text, not a PNG")
    return d


@pytest.fixture(scope="module")
def in_process(tiny_qwen2_vl: str, inputs: Path, tmp_path_factory) -> tuple[Path, object]:
    out = tmp_path_factory.mktemp("ocr-out")
    r = ocr(str(inputs / "report.pdf"), str(inputs / "corrupt.pdf"), str(inputs / "pages"),
            str(inputs / "locked.pdf"), str(inputs / "fake.png"), "-o", str(out),
            "--format", "jsonl", "--model", tiny_qwen2_vl, "--max-concurrency", "3")
    return out, r


def test_pdf_pages_in_order_as_the_same_images(in_process: tuple[Path, object]) -> None:
    out, r = in_process
    rows = jsonl(out / "report.pdf.jsonl")
    assert [(x["page"], x["pages"]) for x in rows] == [(i, PAGES) for i in range(1, 5)]
    for x in rows:
        assert x["error"] is None and x["completion_tokens"] == 6 and x["attempts"] == 1
        assert x["prompt_tokens"] > 0 and x["seconds"] > 0 and max(x["width"], x["height"]) == 64
    images = {}
    for i in range(1, PAGES + 1):
        sub = "deeper/" if (i - 1) % 2 else ""
        (row,) = jsonl(out / "pages" / f"{sub}page-{i}.png.jsonl")
        images[i] = row["text"]
    assert [x["text"] for x in rows] == [images[i] for i in range(1, PAGES + 1)]
    assert not (out / "pages" / "notes.txt.jsonl").exists()


def test_unreadable_documents_are_reported_and_the_run_goes_on(
        in_process: tuple[Path, object]) -> None:
    out, r = in_process
    assert r.returncode == 1, r.stderr[-3000:]
    summary = {Path(e["document"]).name: e for e in json.loads(
        (out / "ocr-summary.json").read_text())}
    assert {k for k, e in summary.items() if e["status"] == "ok"} == \
        {"report.pdf"} | {f"page-{i}.png" for i in range(1, PAGES + 1)}
    assert "corrupt" in summary["corrupt.pdf"]["error"]
    assert "encrypted" in summary["locked.pdf"]["error"]
    assert "not an image" in summary["fake.png"]["error"]
    for name in ("corrupt.pdf", "locked.pdf", "fake.png"):
        assert summary[name]["status"] == "failed" and "FAILED" in r.stderr
        assert not list(out.glob(name + "*"))  # no output, no partial file
    assert "5 documents done, 3 failed" in r.stderr


def test_markdown_pages_numbered_then_resume_skips_finished(tiny_qwen2_vl: str, inputs: Path,
                                                            tmp_path: Path) -> None:
    r = ocr(str(inputs / "report.pdf"), "-o", str(tmp_path), "--model", tiny_qwen2_vl)
    assert r.returncode == 0, r.stderr[-3000:]
    md = (tmp_path / "report.pdf.md").read_text()
    marks = [f"<!-- page {i}/{PAGES} -->" for i in range(1, PAGES + 1)]
    assert all(m in md for m in marks)
    assert [md.index(m) for m in marks] == sorted(md.index(m) for m in marks)
    before = (tmp_path / "report.pdf.md").stat().st_mtime_ns
    # Nothing left to do: no engine is started (a bogus --model would fail if it were).
    r = ocr(str(inputs / "report.pdf"), "-o", str(tmp_path), "--resume",
            "--model", str(tmp_path / "no-such-checkpoint"))
    assert r.returncode == 0, r.stderr[-3000:]
    assert "0 documents done, 0 failed, 1 skipped" in r.stderr
    assert (tmp_path / "report.pdf.md").stat().st_mtime_ns == before


@pytest.fixture(scope="module")
def server(tiny_qwen2_vl: str, tmp_path_factory):
    yield from module_server(tiny_qwen2_vl, tmp_path_factory)


def test_server_mode_transcribes_as_in_process(in_process: tuple[Path, object], inputs: Path,
                                               server, tmp_path: Path) -> None:
    r = ocr(str(inputs / "report.pdf"), "-o", str(tmp_path), "--format", "jsonl",
            "--server", server.base)
    assert r.returncode == 0, r.stderr[-3000:]
    local = jsonl(in_process[0] / "report.pdf.jsonl")
    remote = jsonl(tmp_path / "report.pdf.jsonl")
    assert [(x["page"], x["text"], x["completion_tokens"]) for x in remote] == \
        [(x["page"], x["text"], x["completion_tokens"]) for x in local]


class FakeBackend:
    """Answers from a script of replies (status, body), one per request."""

    served_model = "m"

    def __init__(self, replies: list[tuple[int, dict]]) -> None:
        self.replies, self.sent = list(replies), 0

    async def post(self, path: str, body: dict) -> Reply:
        self.sent += 1
        status, data = self.replies.pop(0)
        return Reply(status, data, "rid")


OK = (200, {"choices": [{"message": {"content": "text"}, "finish_reason": "stop"}],
            "usage": {"prompt_tokens": 5, "completion_tokens": 1}})


def test_transient_failures_are_retried_and_refusals_are_not() -> None:
    args = Namespace(max_tokens=4, temperature=0.0, top_p=None, request_seed=None,
                     max_page_retries=2)
    job = PageJob(doc=None, number=1, image=b"png")  # type: ignore[arg-type]
    err = {"error": {"message": "busy"}}
    b = FakeBackend([(500, err), (503, err), OK])
    r = asyncio.run(transcribe(b, args, job, "p"))
    assert (r.text, r.error, r.attempts, b.sent) == ("text", None, 3, 3)
    b = FakeBackend([(500, err)] * 3)
    r = asyncio.run(transcribe(b, args, job, "p"))
    assert r.error == "HTTP 500: busy" and r.attempts == 3 and b.sent == 3
    b = FakeBackend([(400, {"error": {"message": "too big"}}), OK])
    r = asyncio.run(transcribe(b, args, job, "p"))
    assert r.error == "HTTP 400: too big" and b.sent == 1


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def _peak_growth(pdf: Path) -> tuple[int, int]:
    """(pages, peak RSS growth in bytes) while rasterizing the whole PDF page by page."""
    gc.collect()
    base = peak = _rss()
    n = 0
    for page in iter_pages(str(pdf), dpi=72):
        n += 1
        assert page.width == 600 and page.height == 780
        peak = max(peak, _rss())
    return n, peak - base


def test_memory_stays_flat_over_a_long_pdf(tmp_path: Path) -> None:
    # Small images on big pages (resolution 36: 300x390 px -> 600x780 pt): the PDF is
    # quick to make, yet each page renders to 600x780 RGB (1.4 MB), so holding a 200-page
    # document's bitmaps would cost ~280 MB, and even PDFium's parsed objects of every page
    # (what PdfReader's reopening drops) ~14 MB more than the short document's. Measured
    # here: +2 MB with the reopening, +14 MB without.
    def pages(n: int) -> list[Image.Image]:
        return [page_image(i, (300, 390)) for i in range(n)]

    short = write_pdf(tmp_path / "short.pdf", pages(10), resolution=36.0)
    long = write_pdf(tmp_path / "long.pdf", pages(200), resolution=36.0)
    gc.collect()
    _peak_growth(short)  # warm up: PDFium's and Pillow's one-time allocations
    n_short, short_growth = _peak_growth(short)
    n_long, long_growth = _peak_growth(long)
    assert (n_short, n_long) == (10, 200)
    assert long_growth < short_growth + 8 * 2**20, (short_growth, long_growth)


def test_writers_number_pages_and_publish_only_finished_documents(tmp_path: Path) -> None:
    from triptych.jobs.ocr_output import DocWriter, PageResult, finished

    w = DocWriter(str(tmp_path), "sub/doc.pdf", "text", "doc.pdf")
    w.page(1, 2, PageResult(text="first\n"))
    w.page(2, 2, PageResult(error="HTTP 400: too big"))
    assert not finished(str(tmp_path), "sub/doc.pdf", "text")
    assert w.finish() == str(tmp_path / "sub" / "doc.pdf.txt")
    assert (tmp_path / "sub" / "doc.pdf.txt").read_text() == (
        "=== page 1/2 ===\nfirst\n\n=== page 2/2 (failed: HTTP 400: too big) ===\n\n")
    assert finished(str(tmp_path), "sub/doc.pdf", "text")
    w = DocWriter(str(tmp_path), "gone.pdf", "markdown", "gone.pdf")
    w.page(1, 3, PageResult(text="x"))
    w.discard()
    assert list(tmp_path.iterdir()) == [tmp_path / "sub"]


def test_help_names_every_flag_with_its_default() -> None:
    r = subprocess.run([sys.executable, "-m", "triptych", "ocr", "--help"],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "COLUMNS": "200"})
    assert r.returncode == 0
    for text in ("--output-dir", "--format", "(default: markdown)", "--dpi",
                 "(default: 150.0)", "--target-longest-dim", "--max-page-retries",
                 "(default: 3)", "--max-page-error-rate", "(default: 0.004)", "--prompt-file",
                 "--max-tokens", "(default: 2048)", "--resume", "--server",
                 "--encode-workers"):
        assert text in r.stdout, text
