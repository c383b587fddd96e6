"""Batch jobs read untrusted inputs (issue 36, rows 5-9): a PDF page's pixels are worked out
from its size before it is rendered (--max-page-pixels), images open with the server's
decoders only, a folder's symlinks stay inside it, --server takes an API key, and run-batch
reads lines of bounded length into a window bounded in bytes.
"""
from __future__ import annotations

import asyncio
import io
import json
import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
from PIL import Image
from triptych.jobs.driver import ordered_map
from triptych.jobs.ocr_sources import discover, load_image, pages
from triptych.jobs.pdf import (
    DocumentError,
    PageError,
    PageSize,
    Rasterizer,
    bitmap_size,
)

sys.path.insert(0, os.path.dirname(__file__))
from server_fixtures import img, module_server  # noqa: E402

TIMEOUT = 300  # seconds any one CLI run may take here
KEYS = {"alice": "key-alice-0123456789"}


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


def cli(command: str, *args: str, env: dict[str, str] | None = None
        ) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k != "OPENAI_API_KEY"}
    return subprocess.run([sys.executable, "-m", "triptych", command, "--no-progress", *args],
                          capture_output=True, text=True, timeout=TIMEOUT,
                          env={**base, **(env or {})})


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
    r = cli("ocr", str(pdf), "-o", str(tmp_path / "out"), "--format", "jsonl", "--dpi", "72",
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


# -- row 8: --api-key for --server -------------------------------------------------------------
@pytest.fixture(scope="module")
def keyed_server(tiny_qwen2_vl: str, tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys"
    path.write_text("".join(f"{k} {t}\n" for t, k in KEYS.items()))
    path.chmod(0o600)
    yield from module_server(tiny_qwen2_vl, tmp_path_factory, "--api-keys-file", str(path))


def line(cid: str, prompt: str = "hello") -> str:
    return json.dumps({"custom_id": cid, "method": "POST", "url": "/v1/completions",
                       "body": {"prompt": prompt, "max_tokens": 2, "temperature": 0}})


def results(path: Path) -> list[dict]:
    return [json.loads(x) for x in path.read_text().splitlines()]


def test_server_mode_sends_the_api_key_and_names_a_401(keyed_server, tmp_path: Path) -> None:
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text(line("a") + "\n")
    batch = ("-i", str(src), "-o", str(out), "--server", keyed_server.base)
    r = cli("run-batch", *batch)
    assert r.returncode == 2 and "the server refused the API key (HTTP 401)" in r.stderr, r.stderr
    assert "pass --api-key or set OPENAI_API_KEY" in r.stderr
    r = cli("run-batch", *batch, "--api-key", "wrong-key")
    assert r.returncode == 2 and "(HTTP 401); check --api-key" in r.stderr, r.stderr
    assert "wrong-key" not in r.stderr
    r = cli("run-batch", *batch, "--api-key", KEYS["alice"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert results(out)[0]["response"]["status_code"] == 200
    r = cli("run-batch", *batch, env={"OPENAI_API_KEY": KEYS["alice"]})
    assert r.returncode == 0, r.stderr[-3000:]
    assert results(out)[0]["response"]["status_code"] == 200
    img(3).save(tmp_path / "page.png")
    r = cli("ocr", str(tmp_path / "page.png"), "-o", str(tmp_path / "ocr"), "--max-tokens", "2",
            "--server", keyed_server.base, "--api-key", KEYS["alice"])
    assert r.returncode == 0, r.stderr[-3000:]
    assert "<!-- page 1/1 -->" in (tmp_path / "ocr" / "page.png.md").read_text()


# -- row 9: run-batch lines of bounded length, a window bounded in bytes ------------------------
def test_a_too_long_line_is_an_error_line_and_the_job_goes_on(keyed_server,
                                                              tmp_path: Path) -> None:
    at_limit = line("at-limit")
    at_limit += " " * (2000 - len(at_limit))  # exactly --max-line-bytes: read
    lines = [line("a"), line("long", "x" * 3000), line("b"), at_limit, "  ", line("c")]
    src, out = tmp_path / "in.jsonl", tmp_path / "out.jsonl"
    src.write_text("\n".join(lines))  # (the last line without its newline)
    r = cli("run-batch", "-i", str(src), "-o", str(out), "--server", keyed_server.base,
            "--api-key", KEYS["alice"], "--max-line-bytes", "2000")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = results(out)
    assert [x["custom_id"] for x in rows] == ["a", None, "b", "at-limit", "c"]
    assert rows[1]["response"] is None
    assert rows[1]["error"]["message"] == \
        f"line 2: {len(lines[1]) + 1} bytes, longer than --max-line-bytes (2000)"
    assert all(x["response"]["status_code"] == 200 for i, x in enumerate(rows) if i != 1)


def test_read_line_counts_a_line_without_its_newline_across_chunks() -> None:
    from triptych.jobs.run_batch import read_line

    f = io.BytesIO(b"abcdef\n" + b"x" * 25 + b"\n\n1234567\n123456" + b"\r\n1234567")
    got = []
    while (x := read_line(f, 6, chunk_size=4)) is not None:
        got.append(x)
    assert got == [(b"abcdef\n", 7), (None, 26), (b"\n", 1), (None, 8), (None, 8),
                   (None, 7)]


MAXRSS = """
import resource, subprocess, sys
rc = subprocess.run(sys.argv[1:]).returncode
print(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024)
sys.exit(rc)
"""


def test_lines_over_the_limit_are_never_held_whole(keyed_server, tmp_path: Path) -> None:
    def peak_rss(name: str, lines: list[str], *flags: str) -> tuple[int, list[dict]]:
        src, out = tmp_path / f"{name}.jsonl", tmp_path / f"{name}-out.jsonl"
        with open(src, "w") as f:
            for x in lines:
                f.write(x + "\n")
        r = subprocess.run([sys.executable, "-c", MAXRSS, sys.executable, "-m", "triptych",
                            "run-batch", "--no-progress", "-i", str(src), "-o", str(out),
                            "--server", keyed_server.base, "--api-key", KEYS["alice"], *flags],
                           capture_output=True, text=True, timeout=TIMEOUT)
        assert r.returncode == 0, r.stderr[-3000:]
        return int(r.stdout), results(out)

    small = [line("a"), line("b")]
    big = line("big", "x" * (70 << 20))  # over the default --max-line-bytes (64 MiB)
    base, _ = peak_rss("small", small)
    peak, rows = peak_rss("big", [small[0], big, big, small[1]])
    assert [x["custom_id"] for x in rows] == ["a", None, None, "b"]
    assert "longer than --max-line-bytes (67108864)" in rows[1]["error"]["message"]
    # What reading a line may cost is bounded by the limit, not by the line: its first
    # --max-line-bytes are held until it is known to be too long (+120 MB here over the
    # small file, allocator slack included; the code before this held the parsed lines:
    # +430 MB for these two, 1.5 GB for two 100 MB lines).
    assert peak < base + 3 * (64 << 20), (base, peak)
    peak, rows = peak_rss("big", [small[0], big, big, small[1]], "--max-line-bytes", "1000000")
    assert [x["custom_id"] for x in rows] == ["a", None, None, "b"]
    assert peak < base + (16 << 20), (base, peak)


def test_ordered_map_holds_a_bounded_number_of_bytes() -> None:
    sizes = [10, 40, 5, 500, 30, 30, 30, 30, 1, 1, 1, 1, 60, 60, 60, 60]
    state = {"held": 0, "peak": 0}

    async def source():
        for i, n in enumerate(sizes):
            state["held"] += n
            state["peak"] = max(state["peak"], state["held"])
            yield i

    async def work(i: int) -> int:
        await asyncio.sleep(0.001 * ((i * 7) % 5))  # finish out of order
        return i

    async def main() -> list[int]:
        out = []
        async for i, _ in ordered_map(source(), work, concurrency=8, window=100,
                                      size=lambda i: sizes[i], max_bytes=100):
            state["held"] -= sizes[i]
            out.append(i)
        return out

    assert asyncio.run(main()) == list(range(len(sizes)))  # the 500-byte item too
    assert state["peak"] < 100 + 500, state


def test_help_names_the_new_flags_and_their_defaults() -> None:
    from triptych.jobs.backend import _serve_defaults
    from triptych.jobs.run_batch import DEFAULT_MAX_LINE_BYTES

    assert DEFAULT_MAX_LINE_BYTES == _serve_defaults().max_request_bytes
    env = {**os.environ, "COLUMNS": "200"}
    for command, texts in (("run-batch", ("--max-line-bytes", "(default: 67108864)",
                                          "--api-key", "OPENAI_API_KEY")),
                           ("ocr", ("--max-page-pixels", "(default: 32000000)", "--api-key"))):
        r = subprocess.run([sys.executable, "-m", "triptych", command, "--help"],
                           capture_output=True, text=True, timeout=120, env=env)
        assert r.returncode == 0
        for text in texts:
            assert text in r.stdout, (command, text)
