"""`triptych ocr PATH... -o OUT`: images, folders and PDFs transcribed page by page.

    documents (jobs/ocr_sources.py) -> pages, rendered one at a time (jobs/pdf.py)
      -> one chat request per page (image + prompt), at most --max-concurrency at once,
         retried up to --max-page-retries times on a transient failure (jobs/driver.py);
         or, --layout lines (auto: the demo model), one per text line (jobs/ocr_lines.py)
      -> pages back in order into one file per document (jobs/ocr_output.py)

A document whose failed-page fraction exceeds --max-page-error-rate is reported failed and
gets no output file; one that cannot be read at all (corrupt or encrypted PDF, not an
image) likewise. Neither stops the run: the summary lists them and the exit status is 1.
"""
from __future__ import annotations

import argparse
import asyncio
import base64
import json
import logging
import os
import sys
import time
from typing import Any

import httpx
from triptych.jobs.backend import Backend, add_backend_args, open_backend
from triptych.jobs.driver import CtrlC, ordered_map
from triptych.jobs.ocr_lines import LAYOUTS, reads_lines, transcribe_lines
from triptych.jobs.ocr_output import EXTENSIONS, DocWriter, PageResult, finished
from triptych.jobs.ocr_sources import Document, PageJob, discover, pages
from triptych.jobs.pdf import DEFAULT_MAX_PAGE_PIXELS, PageSize, Rasterizer
from triptych.jobs.progress import Progress

logger = logging.getLogger("triptych.jobs")
DEFAULT_PROMPT = "Transcribe all the text on this page, in reading order."
SUMMARY_FILE = "ocr-summary.json"
RETRYABLE = {408, 429}  # and every 5xx: the others are the page's own fault (too big, ...)
# Bytes of page images held at once (rendered, in flight, or waiting for an earlier page),
# beside the count bound of 4 x --max-concurrency; a page is always let in when none is.
WINDOW_BYTES = 256 << 20


class ServerGone(RuntimeError):
    """The server cannot be reached: stop (a rerun with --resume goes on)."""


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "ocr", help="transcribe images, folders and PDFs page by page",
        description="Transcribe images, folders (searched recursively for images and PDFs) "
                    "and PDFs (rasterized page by page) with the model: one output file per "
                    "document in OUT, pages in order. See docs/jobs.md.")
    p.add_argument("paths", nargs="+", metavar="PATH", help="image files, PDFs, folders")
    o = p.add_argument_group("output")
    o.add_argument("-o", "--output-dir", required=True, help="folder for the results (required)")
    o.add_argument("--format", choices=sorted(EXTENSIONS), default="markdown",
                   help="markdown or text (page-numbered), or jsonl (one object per page "
                        "with tokens, timings and errors)")
    o.add_argument("--resume", action="store_true",
                   help="skip documents whose output file already exists (finished ones)")
    o.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    r = p.add_argument_group("pages")
    r.add_argument("--dpi", type=float, default=150.0, help="PDF rendering resolution")
    r.add_argument("--target-longest-dim", type=int, default=None,
                   help="render PDF pages (and resize images) so their longest side has "
                        "this many pixels, instead of --dpi (default: unset)")
    r.add_argument("--max-page-pixels", type=int, default=DEFAULT_MAX_PAGE_PIXELS,
                   help="most pixels of a page image, worked out from the page's size before "
                        "anything is rendered or decoded: a PDF page bigger than this at "
                        "--dpi / --target-longest-dim is rendered smaller to fit (with a "
                        "warning); an image file bigger than this fails. The default is a "
                        "default server's image cap (--max-image-pixels)")
    r.add_argument("--layout", choices=LAYOUTS, default="auto",
                   help="page: send each page whole; lines: find its text lines and send "
                        "each line (demo/layout/), for a model that reads lines; auto: "
                        "lines for the built-in demo model, page for any other")
    r.add_argument("--max-concurrency", type=int, default=16,
                   help="pages in flight at once (and requests, with --layout lines)")
    r.add_argument("--max-page-retries", type=int, default=3,
                   help="further attempts for a page whose request failed transiently "
                        "(5xx, 408, 429, timeout)")
    r.add_argument("--max-page-error-rate", type=float, default=0.004,
                   help="a document whose fraction of failed pages exceeds this is reported "
                        "failed (0: any failed page fails the document)")
    s = p.add_argument_group("prompt and sampling")
    s.add_argument("--prompt", default=DEFAULT_PROMPT, help="text sent with each page image")
    s.add_argument("--prompt-file", default=None,
                   help="read the prompt from this file instead (default: unset)")
    s.add_argument("--max-tokens", type=int, default=2048, help="most tokens per page")
    s.add_argument("--temperature", type=float, default=0.0, help="sampling temperature")
    s.add_argument("--top-p", type=float, default=None, help="nucleus sampling (default: unset)")
    s.add_argument("--request-seed", type=int, default=None,
                   help="seed sent with each page's request (default: unset; --seed below "
                        "seeds the in-process engine's default generator)")
    add_backend_args(p)


def page_body(args: argparse.Namespace, image: bytes, mime: str, model: str, prompt: str
              ) -> dict:
    """The chat request of one page or line image (what a client of `triptych serve` would
    send)."""
    url = f"data:{mime};base64," + base64.b64encode(image).decode()
    body: dict[str, Any] = {
        "model": model, "max_tokens": args.max_tokens, "temperature": args.temperature,
        "messages": [{"role": "user", "content": [
            {"type": "image_url", "image_url": {"url": url}},
            {"type": "text", "text": prompt}]}]}
    if args.top_p is not None:
        body["top_p"] = args.top_p
    if args.request_seed is not None:
        body["seed"] = args.request_seed
    return body


async def transcribe(backend: Backend, args: argparse.Namespace, job: PageJob, prompt: str
                     ) -> PageResult:
    """One page's result, retried on transient failures; raises only ServerGone."""
    if job.error is not None:
        return PageResult(error=job.error)
    return await request(backend, args, page_body(args, job.image or b"", job.mime,
                                                  backend.served_model, prompt))


async def request(backend: Backend, args: argparse.Namespace, body: dict) -> PageResult:
    """One chat request's result, retried on transient failures; raises only ServerGone."""
    start, error = time.monotonic(), "no attempt"
    for attempt in range(1, args.max_page_retries + 2):
        try:
            r = await backend.post("/v1/chat/completions", body)
        except httpx.TimeoutException:
            error = "the request timed out (--request-timeout)"
            continue
        except httpx.TransportError as e:
            raise ServerGone(f"the server cannot be reached ({type(e).__name__})") from e
        if r.status == 200 and isinstance(r.body, dict):
            choice, usage = r.body["choices"][0], r.body.get("usage") or {}
            return PageResult(choice["message"].get("content") or "", None,
                              usage.get("prompt_tokens", 0), usage.get("completion_tokens", 0),
                              choice.get("finish_reason"), attempt, time.monotonic() - start)
        err = r.body.get("error") if isinstance(r.body, dict) else None
        error = f"HTTP {r.status}: " + (str(err.get("message")) if isinstance(err, dict)
                                        else "no error body")
        if r.status < 500 and r.status not in RETRYABLE:
            break
    return PageResult(error=error, attempts=attempt, seconds=time.monotonic() - start)


def _doc_failed(doc: Document, max_rate: float) -> bool:
    if doc.error is not None:
        return True
    return bool(doc.total) and doc.failed_pages / doc.total > max_rate


async def run_ocr(args: argparse.Namespace, docs: list[Document], prompt: str
                  ) -> list[dict]:
    """Transcribe ``docs``; returns the summary (one entry per document)."""
    summary: dict[Document, dict] = {}
    todo = []
    for d in docs:
        if args.resume and finished(args.output_dir, d.name, args.format):
            summary[d] = {"document": str(d.path), "status": "skipped"}
        else:
            todo.append(d)
    if not todo:  # (nothing to do: do not start an engine for it)
        return [summary[d] for d in docs]
    progress = Progress(0, "page", "ocr", disable=args.no_progress)
    raster = Rasterizer()
    writers: dict[Document, DocWriter] = {}
    limit = asyncio.Semaphore(args.max_concurrency)  # line requests in flight (--layout lines)

    async def read_line(png: bytes) -> PageResult:
        return await request(backend, args,
                             page_body(args, png, "image/png", backend.served_model, prompt))

    async def one(job: PageJob) -> PageResult:
        if lines and job.error is None:
            result = await transcribe_lines(job.image or b"", read_line, limit)
        else:
            result = await transcribe(backend, args, job, prompt)
        if job.number:
            progress.done(1, result.completion_tokens)
        return result

    def close_doc(doc: Document) -> None:
        w = writers.pop(doc, None)
        failed = _doc_failed(doc, args.max_page_error_rate)
        entry = {"document": str(doc.path), "status": "failed" if failed else "ok",
                 "pages": doc.total or 0, "failed_pages": doc.failed_pages,
                 "error": doc.error or ("; ".join(doc.errors) if failed else None)}
        if w is not None:
            if failed:
                w.discard()
            else:
                entry["output"] = w.finish()
        summary[doc] = entry

    try:
        async with CtrlC() as ctrl_c, open_backend(args, args.max_concurrency) as backend:
            lines = reads_lines(args.layout, backend.served_model)
            size = PageSize(args.dpi, args.target_longest_dim, args.max_page_pixels)
            stream = pages(todo, raster, size, lambda d: progress.add_total(d.total or 0))
            async for job, result in ordered_map(stream, one, args.max_concurrency,
                                                 size=lambda j: len(j.image or b""),
                                                 max_bytes=WINDOW_BYTES):
                ctrl_c.check()
                doc = job.doc
                if job.number == 0:  # the document could not be read
                    close_doc(doc)
                    continue
                if doc not in writers:
                    writers[doc] = DocWriter(args.output_dir, doc.name, args.format,
                                             str(doc.path))
                if result.error is not None:
                    doc.failed_pages += 1
                    if len(doc.errors) < 3:
                        doc.errors.append(f"page {job.number}: {result.error}")
                writers[doc].page(job.number, doc.total or 0, result, job.width, job.height)
                doc.done_pages += 1
                if doc.done_pages == doc.total:
                    close_doc(doc)
    finally:
        for w in writers.values():  # interrupted: the partial files go
            w.discard()
        progress.close()
        raster.close()
    return [summary[d] for d in docs if d in summary]


def _report(summary: list[dict], out_dir: str) -> int:
    """Write the summary file, print it on stderr; exit status 1 if a document failed."""
    with open(os.path.join(out_dir, SUMMARY_FILE), "w", encoding="utf-8") as f:
        json.dump(summary, f, indent=1, ensure_ascii=False)
    by = {k: [e for e in summary if e["status"] == k] for k in ("ok", "failed", "skipped")}
    pages_ = sum(e.get("pages", 0) for e in summary)
    print(f"ocr: {len(by['ok'])} documents done, {len(by['failed'])} failed, "
          f"{len(by['skipped'])} skipped (already done); {pages_} pages, "
          f"{sum(e.get('failed_pages', 0) for e in summary)} failed", file=sys.stderr)
    for e in by["failed"]:
        print(f"  FAILED {e['document']}: {e['error']}", file=sys.stderr)
    return 1 if by["failed"] else 0


def run(args: argparse.Namespace) -> int:
    from triptych.cli import fail

    if args.max_concurrency < 1 or args.max_page_retries < 0 or args.max_tokens < 1:
        fail("--max-concurrency and --max-tokens must be at least 1, --max-page-retries >= 0")
    if not 0.0 <= args.max_page_error_rate <= 1.0:
        fail("--max-page-error-rate must be between 0 and 1")
    if not args.dpi > 0 or (args.target_longest_dim is not None and args.target_longest_dim < 1) \
            or args.max_page_pixels < 1:
        fail("--dpi, --target-longest-dim and --max-page-pixels must be positive")
    prompt = args.prompt
    if args.prompt_file:
        try:
            with open(args.prompt_file, encoding="utf-8") as f:
                prompt = f.read().strip()
        except OSError as e:
            fail(f"--prompt-file {args.prompt_file}: {e.strerror}")
    try:
        docs = discover(args.paths)
    except ValueError as e:
        fail(str(e))
    os.makedirs(args.output_dir, exist_ok=True)
    try:
        summary = asyncio.run(run_ocr(args, docs, prompt))
    except ServerGone as e:
        print(f"triptych: error: {e}; rerun with --resume to go on", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("triptych: interrupted; rerun with --resume to go on", file=sys.stderr)
        return 130
    return _report(summary, args.output_dir)
