"""What `triptych ocr` reads: documents found under its paths, and their pages as a stream.

A path is a file (any file: a PDF is recognised by its ``%PDF-`` header, anything else must
be an image Pillow reads) or a folder (searched recursively for files with an image or PDF
extension, in sorted order). Pages come out one at a time, in document and page order,
rendered only when the consumer asks for the next one (jobs/driver.py pulls as its window
frees up), so at no time is more than the window's worth of pages in memory.
"""
from __future__ import annotations

import asyncio
import io
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image
from triptych.jobs.pdf import DocumentError, Rasterizer

IMAGE_EXTENSIONS = {".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff"}
PDF_EXTENSIONS = {".pdf"}


@dataclass(eq=False)
class Document:
    """One input document and its progress (pages counted, nothing of them kept)."""

    path: Path
    name: str  # output name relative to the output folder, before the format's extension
    total: int | None = None  # pages, once known
    done_pages: int = 0
    failed_pages: int = 0
    error: str | None = None  # the document could not be read at all
    errors: list[str] = field(default_factory=list)  # first few page errors, for the summary


@dataclass(eq=False)
class PageJob:
    """One page to transcribe (``image``), or a page / document that failed before any
    request (``error``; ``number`` 0 means the whole document)."""

    doc: Document
    number: int
    image: bytes | None = None
    mime: str = "image/png"
    width: int = 0
    height: int = 0
    error: str | None = None


def discover(paths: list[str]) -> list[Document]:
    """The documents under ``paths`` in order, each with a distinct output name. Raises
    ValueError for a path that does not exist or two inputs with the same output name."""
    docs: list[Document] = []
    for raw in paths:
        p = Path(raw).expanduser()
        if p.is_dir():
            wanted = IMAGE_EXTENSIONS | PDF_EXTENSIONS
            found = sorted(f for f in p.rglob("*") if f.is_file()
                           and f.suffix.lower() in wanted)
            root = p.resolve().name or "root"
            docs += [Document(f, str(Path(root) / f.relative_to(p))) for f in found]
        elif p.is_file():
            docs.append(Document(p, p.name))
        else:
            raise ValueError(f"{raw}: no such file or folder")
    names: dict[str, Path] = {}
    for d in docs:
        if d.name in names:
            raise ValueError(f"{names[d.name]} and {d.path} would both be written as "
                             f"{d.name}.*; pass them in separate runs")
        names[d.name] = d.path
    return docs


def is_pdf(path: Path) -> bool:
    with open(path, "rb") as f:
        return b"%PDF-" in f.read(1024)


def load_image(path: Path, target_longest_dim: int | None) -> tuple[bytes, str, int, int]:
    """(encoded bytes, mime, width, height) of an image file, checked by decoding it;
    resized to ``target_longest_dim`` when given. DocumentError if it is no image."""
    try:
        with Image.open(path) as im:
            im.load()
            fmt = (im.format or "").upper()
            if target_longest_dim or fmt not in ("PNG", "JPEG", "WEBP"):
                # Formats a server may not take (TIFF, BMP, ...) and resized pages go as PNG.
                if target_longest_dim:
                    s = target_longest_dim / max(im.size)
                    im = im.resize((max(1, round(im.width * s)), max(1, round(im.height * s))))
                buf = io.BytesIO()
                im.convert("RGB").save(buf, format="PNG")
                return buf.getvalue(), "image/png", im.width, im.height
            return path.read_bytes(), Image.MIME[fmt], im.width, im.height
    except (OSError, ValueError, Image.DecompressionBombError) as e:
        raise DocumentError(f"not an image or a PDF ({type(e).__name__})") from None


async def pages(docs: list[Document], raster: Rasterizer, dpi: float | None,
                target_longest_dim: int | None,
                on_total: Callable[[Document], None] | None = None
                ) -> AsyncIterator[PageJob]:
    """Every page of every document, in order; ``on_total(doc)`` once a document's page
    count is known."""
    for doc in docs:
        try:
            pdf = await asyncio.to_thread(is_pdf, doc.path)
        except OSError as e:
            doc.error = f"cannot read the file ({e.strerror or type(e).__name__})"
            yield PageJob(doc, 0, error=doc.error)
            continue
        if not pdf:
            try:
                data, mime, w, h = await asyncio.to_thread(load_image, doc.path,
                                                           target_longest_dim)
            except DocumentError as e:
                doc.error = str(e)
                yield PageJob(doc, 0, error=doc.error)
                continue
            doc.total = 1
            if on_total:
                on_total(doc)
            yield PageJob(doc, 1, data, mime, w, h)
            continue
        try:
            handle = await raster.open(str(doc.path))
            n = handle.num_pages
        except DocumentError as e:
            doc.error = str(e)
            yield PageJob(doc, 0, error=doc.error)
            continue
        try:
            if n == 0:
                doc.error = "the PDF has no pages"
                yield PageJob(doc, 0, error=doc.error)
                continue
            doc.total = n
            if on_total:
                on_total(doc)
            for i in range(n):
                try:
                    img = await raster.render(handle, i, dpi, target_longest_dim)
                except Exception as e:  # noqa: BLE001 - one page's failure is that page's
                    yield PageJob(doc, i + 1, error=f"rendering failed ({type(e).__name__})")
                    continue
                yield PageJob(doc, i + 1, img.png, "image/png", img.width, img.height)
        finally:
            await raster.close_doc(handle)


__all__ = ["Document", "PageJob", "discover", "load_image", "pages"]
