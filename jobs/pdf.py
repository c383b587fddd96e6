"""PDF pages as images, one page at a time (pypdfium2: PDFium's wheels, no system poppler).

PDFium reads a document on demand from its file, so an open document costs its
cross-reference table, not its pages; each page is loaded, rendered, encoded as PNG and
released before the next one is touched. PDFium does keep the objects it parsed (streams
included) until the document is closed: ~9 MB over 200 pages of a 6.6 MB file here, so it
grows with the file, which for a 2,800-page scan is far too much. ``PdfReader`` therefore
reopens the document every ``REOPEN_EVERY`` pages, and memory depends on one page and a
few dozen pages' objects, not on the length of the document (tests/test_ocr.py measures
it over a long one).

A page's size is the document's to choose (a 553-byte PDF can declare a 14,400 pt square
page: 30,000 px a side at 150 dpi, 2.7 GB of bitmap), so the bitmap's pixel count is
computed from the page size before anything is allocated, and the scale is lowered until
it fits ``--max-page-pixels`` (``PageSize.fit``).

PDFium is not thread-safe: every call into it goes through one ``Rasterizer`` thread.
"""
from __future__ import annotations

import asyncio
import io
import math
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, BinaryIO

import pypdfium2 as pdfium
from triptych.api.media.limits import MediaLimits
from triptych.api.media.pixels import to_rgb8

POINTS_PER_INCH = 72.0
REOPEN_EVERY = 32  # pages rendered before the document is reopened (drops PDFium's objects)
# A page image above a default server's image cap would be refused there anyway.
DEFAULT_MAX_PAGE_PIXELS = MediaLimits.max_image_pixels


class DocumentError(Exception):
    """A document that cannot be read at all (corrupt, encrypted, not a PDF); the message
    is for the run's summary."""


def open_pdf(source: str | BinaryIO) -> Any:
    """An open PdfDocument (close it) of a path or an open file (read from its descriptor,
    which stays open); DocumentError says why one cannot be opened."""
    try:
        if not isinstance(source, str):
            source.seek(0)
        return pdfium.PdfDocument(source)
    except pdfium.PdfiumError as e:
        text = str(e).lower()
        if "password" in text or "security" in text:
            raise DocumentError("encrypted PDF (a password is needed to read it)") from None
        if "format" in text or "file" in text:
            raise DocumentError(f"corrupt or unreadable PDF ({e})") from None
        raise DocumentError(f"cannot open the PDF ({e})") from None


class PageError(Exception):
    """One page that cannot be rendered (the others still are); the message is the page's
    error."""


@dataclass
class PageImage:
    """One rendered page: PNG bytes and the pixel size."""

    png: bytes
    width: int
    height: int
    wanted: tuple[int, int] | None = None  # the size asked for, when max_pixels lowered it


@dataclass(frozen=True)
class PageSize:
    """How big a page's image is: ``dpi`` dots per inch, or the longest side at
    ``target_longest_dim`` pixels; never more than ``max_pixels`` pixels."""

    dpi: float | None = 150.0
    target_longest_dim: int | None = None
    max_pixels: int = DEFAULT_MAX_PAGE_PIXELS

    def scale(self, width_pt: float, height_pt: float) -> float:
        """Pixels per PDF point, as asked for."""
        if self.target_longest_dim:
            return self.target_longest_dim / max(width_pt, height_pt, 1.0)
        return (self.dpi or 150.0) / POINTS_PER_INCH

    def fit(self, width_pt: float, height_pt: float
            ) -> tuple[float, tuple[int, int], tuple[int, int] | None]:
        """(scale, bitmap size, the size asked for if it was lowered to fit ``max_pixels``),
        computed from the page's size alone. PageError for a page with no usable size."""
        if not (math.isfinite(width_pt) and math.isfinite(height_pt)
                and width_pt > 0 and height_pt > 0):
            raise PageError(f"the page has no usable size ({width_pt} x {height_pt} pt)")
        scale = self.scale(width_pt, height_pt)
        wanted = bitmap_size(width_pt, height_pt, scale)
        if wanted[0] * wanted[1] <= self.max_pixels:
            return scale, wanted, None
        # NOTE: each side is ceil(pt * scale) <= pt * scale + 1, so a scale s with
        # (w s + 1)(h s + 1) <= max_pixels fits: the positive root of w h s^2 + (w + h) s
        # - (max_pixels - 1), written so a very long page does not cancel it to 0.
        a, b, c = width_pt * height_pt, width_pt + height_pt, self.max_pixels - 1.0
        scale = 2 * c / (b + math.sqrt(b * b + 4 * a * c))
        if scale <= 0:  # (max_pixels 1: one pixel)
            scale = 1.0 / max(width_pt, height_pt)
        size = bitmap_size(width_pt, height_pt, scale)
        while size[0] * size[1] > self.max_pixels and scale > 0:  # float rounding only
            scale *= 0.999
            size = bitmap_size(width_pt, height_pt, scale)
        return scale, size, wanted


def bitmap_size(width_pt: float, height_pt: float, scale: float) -> tuple[int, int]:
    """The bitmap pypdfium2's ``PdfPage.render(scale=...)`` allocates (no crop, no
    rotation): each side is ``ceil(points * scale)``."""
    return math.ceil(width_pt * scale), math.ceil(height_pt * scale)


def render_page(doc: Any, index: int, size: PageSize = PageSize()) -> PageImage:
    """Page ``index`` (0-based) of an open document as a PNG of at most ``size.max_pixels``
    pixels; the page and its bitmap are released before returning. PageError for a page
    with no usable size."""
    page = doc[index]
    bitmap = None
    try:
        scale, (width, height), wanted = size.fit(*page.get_size())
        bitmap = page.render(scale=scale, rev_byteorder=True)
        if (bitmap.width, bitmap.height) != (width, height):  # (pypdfium2 sized it otherwise)
            raise PageError(f"the page rendered at {bitmap.width} x {bitmap.height} px, "
                            f"not the {width} x {height} px planned")
        image = bitmap.to_pil()  # a view of the bitmap's buffer: encode before closing it
        image = to_rgb8(image)
        buf = io.BytesIO()
        image.save(buf, format="PNG")
        return PageImage(buf.getvalue(), image.width, image.height, wanted)
    finally:
        if bitmap is not None:
            bitmap.close()
        page.close()


class PdfReader:
    """Renders the pages of one PDF, reopening it every ``REOPEN_EVERY`` pages.

    The file is opened once: every reopening reads the same descriptor, never the path
    again (a path swapped for a symlink after the check would otherwise be followed:
    THREATS.md, "open once, keep the descriptor"). A path given is opened here and closed
    with the reader; a file given stays the caller's."""

    def __init__(self, source: str | BinaryIO) -> None:
        self._owned = open(source, "rb") if isinstance(source, str) else None  # noqa: SIM115
        self.file: BinaryIO = self._owned or source  # type: ignore[assignment]
        try:
            self._doc = open_pdf(self.file)
        except BaseException:
            self._close_file()
            raise
        self.num_pages = len(self._doc)
        self._rendered = 0

    def render(self, index: int, size: PageSize = PageSize()) -> PageImage:
        """Page ``index`` (0-based) as a PNG."""
        if self._rendered >= REOPEN_EVERY:
            self._doc.close()
            self._doc = open_pdf(self.file)
            self._rendered = 0
        self._rendered += 1
        return render_page(self._doc, index, size)

    def close(self) -> None:
        self._doc.close()
        self._close_file()

    def _close_file(self) -> None:
        if self._owned is not None:
            self._owned.close()


def iter_pages(path: str, dpi: float | None = 150.0, target_longest_dim: int | None = None,
               max_pixels: int = DEFAULT_MAX_PAGE_PIXELS) -> Iterator[PageImage]:
    """Every page of the PDF at ``path``, in order, one at a time (synchronous; callers on
    an event loop use Rasterizer)."""
    size = PageSize(dpi, target_longest_dim, max_pixels)
    reader = PdfReader(path)
    try:
        for i in range(reader.num_pages):
            yield reader.render(i, size)
    finally:
        reader.close()


class Rasterizer:
    """PDFium off the event loop, on one thread (PDFium allows no concurrent calls)."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="triptych-pdfium")

    async def _call(self, fn: Any, *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self._pool, fn, *args)

    async def open(self, source: str | BinaryIO) -> PdfReader:
        """A reader of the PDF (a path, or a file open for reading: its descriptor is all
        it reads), its ``num_pages`` known; DocumentError if it cannot be read."""
        return await self._call(PdfReader, source)

    async def render(self, reader: PdfReader, index: int, size: PageSize) -> PageImage:
        return await self._call(reader.render, index, size)

    async def close_doc(self, reader: PdfReader) -> None:
        await self._call(reader.close)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


__all__ = ["DEFAULT_MAX_PAGE_PIXELS", "DocumentError", "PageError", "PageImage", "PageSize",
           "PdfReader", "Rasterizer", "bitmap_size", "iter_pages", "open_pdf", "render_page"]
