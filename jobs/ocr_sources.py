"""What `triptych ocr` reads: documents found under its paths, and their pages as a stream.

A path is a file (any file: a PDF is recognised by its ``%PDF-`` header, anything else must
be an image in one of the formats the server decodes) or a folder (searched recursively for
files with an image or PDF extension, in sorted order). Pages come out one at a time, in
document and page order, rendered only when the consumer asks for the next one
(jobs/driver.py pulls as its window frees up), so at no time is more than the window's worth
of pages in memory.

Inputs are untrusted (../shared/THREATS.md): a folder's symlinks that lead outside it are
skipped, images open only with the server's decoders (``IMAGE_FORMATS``: no EPS, which runs
Ghostscript), and no page is decoded or rendered above ``--max-page-pixels``.
"""
from __future__ import annotations

import asyncio
import contextlib
import io
import logging
import math
import os
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO

from PIL import Image
from triptych.api.media.decode import IMAGE_FORMATS
from triptych.api.media.pixels import to_rgb8
from triptych.jobs.pdf import DocumentError, PageError, PageSize, Rasterizer

logger = logging.getLogger("triptych.jobs")
IMAGE_EXTENSIONS = {".png", ".jpg", ".jpeg", ".webp", ".bmp", ".gif", ".tif", ".tiff"}
PDF_EXTENSIONS = {".pdf"}


@dataclass(eq=False)
class Document:
    """One input document and its progress (pages counted, nothing of them kept)."""

    path: Path
    name: str  # output name relative to the output folder, before the format's extension
    folder: Path | None = None  # the input folder (resolved) it was found in; None: named
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


def outside(path: Path, folder: Path) -> str | None:
    """Why ``path`` (found under the resolved ``folder``) must not be read: it leads outside
    the folder or nowhere; None when it stays inside."""
    try:
        target = path.resolve(strict=True)
    except (OSError, RuntimeError):  # (a broken link or a symlink loop)
        return "a symlink that leads nowhere"
    if target != folder and folder not in target.parents:
        return f"a symlink to {target}, outside {folder}"
    return None


def _walk(folder: Path) -> list[Path]:
    """Files under ``folder`` with an image or PDF extension, sorted. Symlinked folders are
    not walked (one inside holds files found under their own names); a symlink, file or
    folder, that leads outside ``folder`` is skipped with a warning."""
    wanted, real = IMAGE_EXTENSIONS | PDF_EXTENSIONS, folder.resolve()
    found = []
    for dirpath, dirnames, filenames in os.walk(folder):  # (followlinks=False)
        here = Path(dirpath)
        for name in dirnames:  # a symlinked folder is listed here, never walked
            if (here / name).is_symlink() and (why := outside(here / name, real)):
                logger.warning("skipping %s: %s", here / name, why)
        for name in filenames:
            f = here / name
            if f.suffix.lower() not in wanted:
                continue
            why = outside(f, real) if f.is_symlink() else None
            if why is not None:
                logger.warning("skipping %s: %s", f, why)
            elif f.is_file():
                found.append(f)
    return sorted(found)


def discover(paths: list[str]) -> list[Document]:
    """The documents under ``paths`` in order, each with a distinct output name. Raises
    ValueError for a path that does not exist or two inputs with the same output name."""
    docs: list[Document] = []
    for raw in paths:
        p = Path(raw).expanduser()
        if p.is_dir():
            real = p.resolve()
            root = real.name or "root"
            docs += [Document(f, str(Path(root) / f.relative_to(p)), real) for f in _walk(p)]
        elif p.is_file():  # named on the command line: read wherever it leads
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


def is_pdf(f: BinaryIO) -> bool:
    f.seek(0)
    head = f.read(1024)
    f.seek(0)
    return b"%PDF-" in head


def open_document(doc: Document) -> tuple[BinaryIO, bool]:
    """``doc``'s file, opened once, and whether it is a PDF. Every later read of the
    document (image bytes, every PDF page, PDFium's reopenings) uses this descriptor, never
    the path: checked once, opened twice is the gap a swapped symlink walks through.
    DocumentError if it cannot be read, or leads outside the folder it was found in (a
    symlink swapped in since the folder was searched, before or while it was opened)."""
    try:
        f = open(doc.path, "rb")  # noqa: SIM115 (kept open for the document's pages)
    except OSError as e:
        raise DocumentError(f"cannot read the file ({e.strerror or type(e).__name__})"
                            ) from None
    try:
        if doc.folder is not None:
            if (why := outside(doc.path, doc.folder)) is not None:
                raise DocumentError(f"not read: {why}")
            # NOTE: what was opened must be what the path leads to now, inside the folder:
            # a swap between the open and the check shows as another file
            opened, now = os.fstat(f.fileno()), os.stat(doc.path.resolve())
            if (opened.st_dev, opened.st_ino) != (now.st_dev, now.st_ino):
                raise DocumentError("not read: the file was replaced while it was opened")
        return f, is_pdf(f)
    except OSError as e:
        f.close()
        raise DocumentError(f"cannot read the file ({e.strerror or type(e).__name__})"
                            ) from None
    except BaseException:
        f.close()
        raise


def load_image(src: Path | BinaryIO, size: PageSize) -> tuple[bytes, str, int, int]:
    """(encoded bytes, mime, width, height) of an image file (a path, or a file open for
    reading: its descriptor is all that is read), checked by decoding it; resized to
    ``size.target_longest_dim`` when given. DocumentError if it is no image the server
    would decode, or has more than ``size.max_pixels`` pixels (from its header: it is not
    decoded)."""
    if isinstance(src, (str, Path)):
        with open(src, "rb") as f:
            return load_image(f, size)
    try:
        src.seek(0)
        with Image.open(src, formats=IMAGE_FORMATS) as im:
            w, h = im.size
            if w * h > size.max_pixels:
                raise DocumentError(f"the image is {w} x {h} px, above --max-page-pixels "
                                    f"({size.max_pixels})")
            im.load()
            fmt = (im.format or "").upper()
            if size.target_longest_dim or fmt not in ("PNG", "JPEG", "WEBP"):
                # Formats a server may not take (TIFF, BMP, ...) and resized pages go as PNG,
                # read as the server reads pixels (upright, 16 bits scaled, ...) first.
                rgb = to_rgb8(im)
                if size.target_longest_dim:
                    rgb = rgb.resize(_resized(rgb.width, rgb.height, size))
                buf = io.BytesIO()
                rgb.save(buf, format="PNG")
                return buf.getvalue(), "image/png", rgb.width, rgb.height
            src.seek(0)
            return src.read(), Image.MIME[fmt], w, h
    except DocumentError:
        raise
    except Exception as e:  # noqa: BLE001 - whatever a decoder raises, the file is no image
        raise DocumentError(f"not an image or a PDF ({type(e).__name__})") from None


def _resized(w: int, h: int, size: PageSize) -> tuple[int, int]:
    """``w`` x ``h`` with the longest side at ``size.target_longest_dim``, shrunk further if
    that is above ``size.max_pixels``."""
    s = (size.target_longest_dim or max(w, h)) / max(w, h)
    out = max(1, round(w * s)), max(1, round(h * s))
    if out[0] * out[1] > size.max_pixels:  # (a target above what --max-page-pixels allows)
        s = math.sqrt(size.max_pixels / (w * h))
        out = max(1, math.floor(w * s)), max(1, math.floor(h * s))
    return out


async def pages(docs: list[Document], raster: Rasterizer, size: PageSize,
                on_total: Callable[[Document], None] | None = None
                ) -> AsyncIterator[PageJob]:
    """Every page of every document, in order; ``on_total(doc)`` once a document's page
    count is known. A document that cannot be read is one job numbered 0."""
    for doc in docs:
        try:
            f, pdf = await asyncio.to_thread(open_document, doc)
        except DocumentError as e:
            doc.error = str(e)
            yield PageJob(doc, 0, error=doc.error)
            continue
        with f:
            if pdf:
                async with contextlib.aclosing(_pdf_pages(doc, f, raster, size, on_total)
                                               ) as jobs:
                    async for job in jobs:
                        yield job
                continue
            try:
                data, mime, w, h = await asyncio.to_thread(load_image, f, size)
            except DocumentError as e:
                doc.error = str(e)
                yield PageJob(doc, 0, error=doc.error)
                continue
        doc.total = 1
        if on_total:
            on_total(doc)
        yield PageJob(doc, 1, data, mime, w, h)


async def _pdf_pages(doc: Document, f: BinaryIO, raster: Rasterizer, size: PageSize,
                     on_total: Callable[[Document], None] | None) -> AsyncIterator[PageJob]:
    try:
        handle = await raster.open(f)
    except DocumentError as e:
        doc.error = str(e)
        yield PageJob(doc, 0, error=doc.error)
        return
    try:
        if handle.num_pages == 0:
            doc.error = "the PDF has no pages"
            yield PageJob(doc, 0, error=doc.error)
            return
        doc.total = handle.num_pages
        if on_total:
            on_total(doc)
        for i in range(handle.num_pages):
            try:
                img = await raster.render(handle, i, size)
            except PageError as e:
                yield PageJob(doc, i + 1, error=str(e))
                continue
            except Exception as e:  # noqa: BLE001 - one page's failure is that page's
                yield PageJob(doc, i + 1, error=f"rendering failed ({type(e).__name__})")
                continue
            if img.wanted is not None:
                logger.warning("%s page %d: %d x %d px is above --max-page-pixels (%d); "
                               "rendered at %d x %d px", doc.path, i + 1, *img.wanted,
                               size.max_pixels, img.width, img.height)
            yield PageJob(doc, i + 1, img.png, "image/png", img.width, img.height)
    finally:
        await raster.close_doc(handle)


__all__ = ["Document", "PageJob", "discover", "load_image", "outside", "pages"]
