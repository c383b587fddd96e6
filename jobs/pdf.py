"""PDF pages as images, one page at a time (pypdfium2: PDFium's wheels, no system poppler).

PDFium reads a document on demand from its file, so an open document costs its
cross-reference table, not its pages; each page is loaded, rendered, encoded as PNG and
released before the next one is touched. Memory therefore depends on one page, not on the
length of the document (tests/test_ocr.py measures it over a long one).

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


def iter_pages(path: str, dpi: float | None = 150.0, target_longest_dim: int | None = None
               ) -> Iterator[PageImage]:
    """Every page of the PDF at ``path``, in order, one at a time (synchronous; callers on
    an event loop use Rasterizer)."""
    doc = open_pdf(path)
    try:
        for i in range(len(doc)):
            yield render_page(doc, i, dpi, target_longest_dim)
    finally:
        doc.close()


class Rasterizer:
    """PDFium off the event loop, on one thread (PDFium allows no concurrent calls)."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="triptych-pdfium")

    async def _call(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def open(self, path: str) -> tuple[Any, int]:
        """(document, page count); DocumentError if it cannot be read."""
        def go() -> tuple[Any, int]:
            doc = open_pdf(path)
            return doc, len(doc)
        return await self._call(go)

    async def render(self, doc: Any, index: int, dpi: float | None,
                     target_longest_dim: int | None) -> PageImage:
        return await self._call(render_page, doc, index, dpi, target_longest_dim)

    async def close_doc(self, doc: Any) -> None:
        await self._call(doc.close)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


__all__ = ["DocumentError", "PageImage", "Rasterizer", "iter_pages", "open_pdf", "render_page"]
