"""PDF pages as images, one page at a time (pypdfium2: PDFium's wheels, no system poppler).

PDFium reads a document on demand from its file, so an open document costs its
cross-reference table, not its pages; each page is loaded, rendered, encoded as PNG and
released before the next one is touched. PDFium does keep the objects it parsed (streams
included) until the document is closed: ~9 MB over 200 pages of a 6.6 MB file here, so it
grows with the file, which for a 2,800-page scan is far too much. ``PdfReader`` therefore
reopens the document every ``REOPEN_EVERY`` pages, and memory depends on one page and a
few dozen pages' objects, not on the length of the document (tests/test_ocr.py measures
it over a long one).

PDFium is not thread-safe: every call into it goes through one ``Rasterizer`` thread.
"""
from __future__ import annotations

import asyncio
import io
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import pypdfium2 as pdfium

POINTS_PER_INCH = 72.0
REOPEN_EVERY = 32  # pages rendered before the document is reopened (drops PDFium's objects)


class DocumentError(Exception):
    """A document that cannot be read at all (corrupt, encrypted, not a PDF); the message
    is for the run's summary."""


@dataclass
class PageImage:
    """One rendered page: PNG bytes and the pixel size."""

    png: bytes
    width: int
    height: int


def open_pdf(path: str) -> Any:
    """An open PdfDocument (close it); DocumentError says why one cannot be opened."""
    try:
        return pdfium.PdfDocument(path)
    except pdfium.PdfiumError as e:
        text = str(e).lower()
        if "password" in text or "security" in text:
            raise DocumentError("encrypted PDF (a password is needed to read it)") from None
        if "format" in text or "file" in text:
            raise DocumentError(f"corrupt or unreadable PDF ({e})") from None
        raise DocumentError(f"cannot open the PDF ({e})") from None


def page_scale(width_pt: float, height_pt: float, dpi: float | None,
               target_longest_dim: int | None) -> float:
    """Pixels per PDF point: the longest side at ``target_longest_dim`` pixels if given,
    else ``dpi`` dots per inch."""
    if target_longest_dim:
        return target_longest_dim / max(width_pt, height_pt, 1.0)
    return (dpi or 150.0) / POINTS_PER_INCH


def render_page(doc: Any, index: int, dpi: float | None = 150.0,
                target_longest_dim: int | None = None) -> PageImage:
    """Page ``index`` (0-based) of an open document as a PNG; the page and its bitmap are
    released before returning."""
    page = doc[index]
    bitmap = None
    try:
        scale = page_scale(*page.get_size(), dpi, target_longest_dim)
        bitmap = page.render(scale=scale)
        image = bitmap.to_pil()  # a view of the bitmap's buffer: encode before closing it
        buf = io.BytesIO()
        image.convert("RGB").save(buf, format="PNG")
        return PageImage(buf.getvalue(), image.width, image.height)
    finally:
        if bitmap is not None:
            bitmap.close()
        page.close()


class PdfReader:
    """Renders the pages of one PDF, reopening it every ``REOPEN_EVERY`` pages."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._doc = open_pdf(path)
        self.num_pages = len(self._doc)
        self._rendered = 0

    def render(self, index: int, dpi: float | None = 150.0,
               target_longest_dim: int | None = None) -> PageImage:
        """Page ``index`` (0-based) as a PNG."""
        if self._rendered >= REOPEN_EVERY:
            self._doc.close()
            self._doc = open_pdf(self.path)
            self._rendered = 0
        self._rendered += 1
        return render_page(self._doc, index, dpi, target_longest_dim)

    def close(self) -> None:
        self._doc.close()


def iter_pages(path: str, dpi: float | None = 150.0, target_longest_dim: int | None = None
               ) -> Iterator[PageImage]:
    """Every page of the PDF at ``path``, in order, one at a time (synchronous; callers on
    an event loop use Rasterizer)."""
    reader = PdfReader(path)
    try:
        for i in range(reader.num_pages):
            yield reader.render(i, dpi, target_longest_dim)
    finally:
        reader.close()


class Rasterizer:
    """PDFium off the event loop, on one thread (PDFium allows no concurrent calls)."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="triptych-pdfium")

    async def _call(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def open(self, path: str) -> PdfReader:
        """A reader of the PDF (its ``num_pages`` known); DocumentError if it cannot be
        read."""
        return await self._call(PdfReader, path)

    async def render(self, reader: PdfReader, index: int, dpi: float | None,
                     target_longest_dim: int | None) -> PageImage:
        return await self._call(reader.render, index, dpi, target_longest_dim)

    async def close_doc(self, reader: PdfReader) -> None:
        await self._call(reader.close)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


__all__ = ["DocumentError", "PageImage", "PdfReader", "Rasterizer", "iter_pages", "open_pdf",
           "render_page"]
