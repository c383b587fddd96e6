"""`triptych run-batch`: OpenAI's batch file format, one result line per request line.

Input lines: ``{"custom_id", "method": "POST", "url": "/v1/chat/completions" |
"/v1/completions", "body": {...}}``. Output lines (vLLM's run-batch shape):
``{"id", "custom_id", "response": {"status_code", "request_id", "body"} | null, "error"}``.
The whole file is checked first (jobs/batch_check.py, vLLM's behaviour): a line that is not
a batch request at all (not JSON, no ``custom_id``, ...) stops the run before anything is
written, exit status 1; ``--per-line-errors`` instead gives such a line an error line. A
line that cannot be sent (unknown url, duplicated ``custom_id``, streaming) gets an error
line with ``response: null``; one the server refuses gets ``response.status_code`` and the
server's error object. Nothing on one of those lines stops the others.

The input is streamed and results are written in input order as they finish (a bounded
window, jobs/driver.py, counted in lines and in bytes), each line flushed whole, so a rerun
with ``--resume`` after a crash or Ctrl-C finds a prefix of the results and goes on from
there (jobs/ledger.py). A line longer than ``--max-line-bytes`` is read through in chunks,
never held whole, and gets an error line.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import sys
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import IO, Any, BinaryIO

import httpx
from triptych.jobs.backend import Backend, add_backend_args, open_backend
from triptych.jobs.driver import CtrlC, ordered_map
from triptych.jobs.ledger import Ledger, key_of, recover
from triptych.jobs.progress import Progress

logger = logging.getLogger("triptych.jobs")
URLS = ("/v1/chat/completions", "/v1/completions")
# serve's --max-request-bytes default: a longer line's body could not be sent anyway.
DEFAULT_MAX_LINE_BYTES = 64 << 20
CHUNK = 1 << 20  # bytes read at a time through a line that is too long


class ServerGone(RuntimeError):
    """The server cannot be reached at all: not one line's fault, so the run stops (and a
    rerun with --resume goes on) instead of writing an error for every remaining line."""


def add_parser(subparsers: Any) -> None:
    p = subparsers.add_parser(
        "run-batch", help="run an OpenAI batch file (JSONL) through the engine",
        description="Run every request of an OpenAI batch file (JSONL lines with custom_id, "
                    "method, url, body) and write one result line per request line, in "
                    "input order (vLLM's run-batch format). See docs/jobs.md.")
    io_ = p.add_argument_group("batch")
    io_.add_argument("-i", "--input-file", required=True,
                     help="batch file (JSONL); '-' reads stdin (required)")
    io_.add_argument("-o", "--output-file", required=True,
                     help="results file (JSONL); '-' writes stdout (required)")
    io_.add_argument("--max-concurrency", type=int, default=64,
                     help="requests in flight at once")
    io_.add_argument("--max-line-bytes", type=int, default=DEFAULT_MAX_LINE_BYTES,
                     help="longest input line in bytes, its newline not counted (serve's "
                          "--max-request-bytes); a longer line is read through without being "
                          "held and gets an error line. The lines held at once (running, or "
                          "waiting for an earlier one) are also kept under 4 x this many "
                          "bytes")
    io_.add_argument("--resume", action="store_true",
                     help="keep the results already in the output file, skip their "
                          "custom_ids and append the rest (a half-written last line is "
                          "removed); without it the output file is overwritten")
    io_.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    io_.add_argument("--per-line-errors", action="store_true",
                     help="a line that is not a batch request (no custom_id, not JSON, ...) "
                          "gets an error line and the others run; without it the whole file "
                          "is checked first and such a line stops the run before anything "
                          "is written, with a non-zero exit (vLLM's behaviour; "
                          "jobs/batch_check.py)")
    add_backend_args(p)


@dataclass
class Line:
    """One input line: its number, and either a request to send or an error to write."""

    number: int
    custom_id: Any = None
    url: str = ""
    body: dict | None = None
    error: dict | None = None
    nbytes: int = 0  # the line's length, while it is held (the window's byte count)


def _error(message: str, param: str | None = None, type_: str = "invalid_request_error",
           code: int | None = 400) -> dict:
    return {"message": message, "type": type_, "param": param, "code": code}


def parse_line(number: int, raw: str) -> Line:
    """A request line checked for everything that can be checked without the server."""
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):
        return Line(number, error=_error(f"line {number}: not valid JSON"))
    if not isinstance(data, dict):
        return Line(number, error=_error(f"line {number}: a request line is a JSON object"))
    line = Line(number, custom_id=data.get("custom_id"))
    if not isinstance(line.custom_id, str) or not line.custom_id:
        line.error = _error(f"line {number}: custom_id must be a non-empty string",
                            "custom_id")
    elif str(data.get("method", "POST")).upper() != "POST":
        line.error = _error(f"line {number}: method must be POST", "method")
    elif data.get("url") not in URLS:
        line.error = _error(f"line {number}: url must be one of {', '.join(URLS)}", "url")
    elif not isinstance(data.get("body"), dict):
        line.error = _error(f"line {number}: body must be a JSON object", "body")
    elif data["body"].get("stream"):
        line.error = _error(f"line {number}: streaming is not supported in a batch",
                            "body.stream")
    else:
        line.url, line.body = data["url"], data["body"]
    return line


def result_line(custom_id: Any, status: int | None = None, request_id: str | None = None,
                body: Any = None, error: dict | None = None) -> dict:
    """An output line; ``status`` None: the request was never sent (``response`` null)."""
    response = None if status is None else {
        "status_code": status, "request_id": request_id, "body": body if error is None else None}
    return {"id": f"batch_req_{uuid.uuid4().hex}", "custom_id": custom_id,
            "response": response, "error": error}


async def send(backend: Backend, line: Line) -> dict:
    """The result line of one request line (never raises, except ServerGone)."""
    if line.error is not None:
        return result_line(line.custom_id, error=line.error)
    body = dict(line.body or {})
    if not body.get("model"):  # vLLM's server too answers a body without model
        body["model"] = backend.served_model
    try:
        r = await backend.post(line.url, body)
    except httpx.TimeoutException:
        return result_line(line.custom_id, error=_error(
            "the request timed out (--request-timeout)", type_="server_error", code=None))
    except httpx.TransportError as e:
        raise ServerGone(f"the server cannot be reached ({type(e).__name__}: {e})") from e
    if 200 <= r.status < 300 and isinstance(r.body, dict):
        return result_line(line.custom_id, r.status, r.request_id, r.body)
    err = r.body.get("error") if isinstance(r.body, dict) else None
    if not isinstance(err, dict):
        err = _error(f"HTTP {r.status}", type_="server_error", code=r.status)
    return result_line(line.custom_id, r.status, r.request_id, error=err)


def read_line(f: BinaryIO, limit: int, chunk_size: int = CHUNK
              ) -> tuple[bytes | None, int] | None:
    """The next line of ``f`` and its length in bytes, or None at the end. The line is read
    ``chunk_size`` bytes at a time; one of more than ``limit`` bytes (its newline not
    counted) is read through, dropping its chunks, and comes back as ``(None, length)``: it
    costs at most ``limit`` bytes of memory whatever its length."""
    parts: list[bytes] | None = []
    n = 0
    while chunk := f.readline(chunk_size):
        n += len(chunk)
        end = chunk.endswith(b"\n")
        if parts is not None and n - end > limit:
            parts = None  # too long: the rest is only counted
        if parts is not None:
            parts.append(chunk)
        if end:
            break
    if n == 0:
        return None
    return (b"".join(parts) if parts is not None else None), n


async def read_lines(f: BinaryIO, limit: int) -> AsyncIterator[tuple[int, str | None, int]]:
    """(line number, text or None if too long, bytes) of each non-blank line, read off the
    event loop (stdin may block; the engine's router shares this loop)."""
    number = 0
    while (got := await asyncio.to_thread(read_line, f, limit)) is not None:
        number += 1
        raw, n = got
        if raw is None or raw.strip():
            yield number, None if raw is None else raw.decode("utf-8", "replace"), n


def _count_requests(path: str, limit: int) -> int | None:
    """Non-blank lines of a regular file (the bar's total, for an ETA); None for stdin."""
    if path == "-" or not os.path.isfile(path):
        return None
    count = 0
    with open(path, "rb") as f:
        while (got := read_line(f, limit)) is not None:
            count += got[0] is None or bool(got[0].strip())
    return count


async def run_batch(args: argparse.Namespace, src: BinaryIO, out: IO[str], ledger: Ledger
                    ) -> dict[str, int]:
    """Stream ``src`` through the backend into ``out``; returns counts of what happened."""
    counts = {"ok": 0, "errors": 0, "skipped": 0}
    seen: dict[Any, int] = {}  # custom_id -> first line (duplicates are refused)
    total = _count_requests(args.input_file, args.max_line_bytes)
    progress = Progress(total, "req", "run-batch", initial=min(ledger.total, total or 0),
                        disable=args.no_progress)

    async def lines() -> AsyncIterator[Line]:
        async for number, text, nbytes in read_lines(src, args.max_line_bytes):
            if text is None:
                line = Line(number, error=_error(
                    f"line {number}: {nbytes} bytes, longer than --max-line-bytes "
                    f"({args.max_line_bytes})"))
            else:
                line = parse_line(number, text)
                line.nbytes = nbytes
            cid = line.custom_id if isinstance(line.custom_id, str) else None
            first = seen.get(cid) if cid is not None else None
            if cid is not None and first is None:
                seen[cid] = number
            if ledger.skip(key_of(line.custom_id)):
                counts["skipped"] += 1
                continue
            if line.error is None and first is not None:
                line.error = _error(f"line {number}: custom_id {cid!r} was already used on "
                                    f"line {first}", "custom_id")
            yield line

    async def one(line: Line) -> dict:
        try:
            result = await send(backend, line)
        except ServerGone:
            raise
        except Exception as e:
            logger.exception("line %d failed", line.number)
            result = result_line(line.custom_id, error=_error(
                f"internal error: {type(e).__name__}", type_="server_error", code=500))
        line.body = None  # sent: only its result waits for the lines before it
        body = (result.get("response") or {}).get("body") or {}
        progress.done(1, int((body.get("usage") or {}).get("completion_tokens") or 0))
        return result

    try:
        async with CtrlC() as ctrl_c, open_backend(args, args.max_concurrency) as backend:
            async for _, result in ordered_map(lines(), one, args.max_concurrency,
                                               size=lambda line: line.nbytes,
                                               max_bytes=4 * args.max_line_bytes):
                # One write per line, flushed: a kill leaves whole lines (and maybe a cut
                # last one, which --resume removes).
                out.write(json.dumps(result, ensure_ascii=False) + "\n")
                out.flush()
                counts["errors" if result["error"] else "ok"] += 1
                ctrl_c.check()
    finally:
        progress.close()
    return counts


def run(args: argparse.Namespace) -> int:
    from triptych.cli import fail

    if args.max_concurrency < 1 or args.max_line_bytes < 1:
        fail("--max-concurrency and --max-line-bytes must be at least 1")
    if args.resume and args.output_file == "-":
        fail("--resume needs an output file (not '-')")
    if args.input_file != "-" and not os.path.isfile(args.input_file):
        fail(f"--input-file {args.input_file}: no such file")
    if args.input_file != "-" and args.output_file != "-" and os.path.exists(args.output_file) \
            and os.path.samefile(args.input_file, args.output_file):
        fail("the output file is the input file")
    from triptych.jobs.batch_check import check_file, spool_stdin

    spooled = None
    if not args.per_line_errors:  # vLLM's: the whole file is checked before any request
        if args.input_file == "-":
            args.input_file = spooled = spool_stdin()
        problem = check_file(args.input_file, args.max_line_bytes, read_line)
        if problem is not None:
            if spooled:
                os.unlink(spooled)
            print(f"triptych: error: {problem}; nothing was run or written (the whole file "
                  "is checked first; --per-line-errors writes an error line for it instead)",
                  file=sys.stderr)
            return 1
    ledger = Ledger(recover(args.output_file, lambda d: key_of(d.get("custom_id")))
                    if args.resume else None)
    if ledger.total:
        logger.info("resuming: %d result lines already in %s", ledger.total, args.output_file)
    src = sys.stdin.buffer if args.input_file == "-" else open(args.input_file, "rb")
    out = sys.stdout if args.output_file == "-" else open(
        args.output_file, "a" if args.resume else "w", encoding="utf-8")
    try:
        counts = asyncio.run(run_batch(args, src, out, ledger))
    except ServerGone as e:
        print(f"triptych: error: {e}; rerun with --resume to go on", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("triptych: interrupted; rerun with --resume to go on", file=sys.stderr)
        return 130
    finally:
        for f in (src, out):
            if f not in (sys.stdin.buffer, sys.stdout):
                f.close()
        if spooled:
            os.unlink(spooled)
    logger.info("run-batch: %d ok, %d errors, %d already done", counts["ok"],
                counts["errors"], counts["skipped"])
    return 0
