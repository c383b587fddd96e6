"""`triptych ocr --layout lines`: a page read line by line (the built-in demo model's way).

    page image -> demo/layout/ (text lines in reading order, each piece as a strip in the
      geometry the model reads) -> one chat request per strip, all of a page's at once
      within --max-concurrency requests over the whole run -> the page's text: a line's
      pieces joined by spaces, lines by newlines

The demo model reads one printed line on a 28-px strip and little else (docs/demo-model.md);
a real vision-language model reads the whole page better, so ``--layout auto`` (the default)
reads lines only for the demo checkpoint.
"""
from __future__ import annotations

import asyncio
import io
import time
from collections.abc import Awaitable, Callable

from triptych.api.media.pixels import to_rgb8
from triptych.demo.layout import line_strips
from triptych.jobs.ocr_output import PageResult

DEMO_NAME = "ocr_demo"  # the served name of the built-in demo checkpoint (demo/ocr_demo)
LAYOUTS = ("auto", "lines", "page")


def reads_lines(layout: str, served_model: str) -> bool:
    """Whether pages go line by line: ``lines``, or ``auto`` with the demo model served."""
    return layout == "lines" or (layout == "auto" and served_model == DEMO_NAME)


def page_strips(image: bytes) -> list[list[bytes]]:
    """The PNG strips of each text line of an encoded page image, in reading order (its
    pixels read as the server reads them: api/media/pixels.py)."""
    from PIL import Image

    with Image.open(io.BytesIO(image)) as im:
        lines = line_strips(to_rgb8(im))
    out = []
    for pieces in lines:
        row = []
        for strip in pieces:
            buf = io.BytesIO()
            strip.save(buf, format="PNG")
            row.append(buf.getvalue())
        out.append(row)
    return out


async def transcribe_lines(image: bytes, request: Callable[[bytes], Awaitable[PageResult]],
                           limit: asyncio.Semaphore) -> PageResult:
    """One page read line by line: ``request(png)`` reads one strip (with its retries);
    ``limit`` bounds the requests in flight over the whole run. The page fails with its
    first failed strip; a page without text lines is read as empty."""
    start = time.monotonic()
    try:
        lines = await asyncio.to_thread(page_strips, image)
    except Exception as e:  # noqa: BLE001 - a page the layout step cannot read fails alone
        return PageResult(error=f"the layout step failed ({type(e).__name__})")

    async def one(png: bytes) -> PageResult:
        async with limit:
            return await request(png)

    results = await asyncio.gather(*(one(p) for row in lines for p in row))
    failed = next((r for r in results if r.error is not None), None)
    if failed is not None:
        return PageResult(error=failed.error, attempts=failed.attempts,
                          seconds=time.monotonic() - start)
    texts, i = [], 0
    for row in lines:
        texts.append(" ".join(t for r in results[i:i + len(row)] if (t := r.text.strip())))
        i += len(row)
    stop = all(r.finish_reason == "stop" for r in results)
    return PageResult("\n".join(texts), None, sum(r.prompt_tokens for r in results),
                      sum(r.completion_tokens for r in results),
                      "stop" if stop else "length", max((r.attempts for r in results), default=0),
                      time.monotonic() - start)


__all__ = ["DEMO_NAME", "LAYOUTS", "page_strips", "reads_lines", "transcribe_lines"]
