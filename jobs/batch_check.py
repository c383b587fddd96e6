"""`triptych run-batch`'s check of the whole input file before any request is sent, as
vLLM's run-batch does: a line that is not a batch request at all (not a JSON object, no
``custom_id`` string, ``method`` / ``url`` not strings, ``body`` not an object, longer than
--max-line-bytes) stops the run with an error naming the line and a non-zero exit, and
nothing is written. Requests the server would refuse (an unknown url or model, a bad
body) are not format errors: each still gets its error line. ``--per-line-errors`` keeps
the older behaviour (every bad line an error line, the rest run; for long OCR jobs that
should not stop on one bad line).

Standard input is copied to a temporary file first, so it can be checked and then read.
"""
from __future__ import annotations

import json
import shutil
import sys
import tempfile
from collections.abc import Callable
from typing import Any


def format_error(number: int, raw: str | None, nbytes: int, limit: int) -> str | None:
    """Why line ``number`` is not a batch request line, or None."""
    if raw is None:
        return f"line {number}: {nbytes} bytes, longer than --max-line-bytes ({limit})"
    try:
        data: Any = json.loads(raw)
    except (ValueError, RecursionError):
        return f"line {number}: not valid JSON"
    if not isinstance(data, dict):
        return f"line {number}: a request line is a JSON object"
    if not isinstance(data.get("custom_id"), str) or not data["custom_id"]:
        return f"line {number}: custom_id must be a non-empty string"
    for key in ("method", "url"):
        if not isinstance(data.get(key), str):
            return f"line {number}: {key} must be a string"
    if not isinstance(data.get("body"), dict):
        return f"line {number}: body must be a JSON object"
    return None


def check_file(path: str, limit: int, read_line: Callable[..., Any]) -> str | None:
    """The first format error of the batch file at ``path``, or None. ``read_line``:
    run_batch's, which reads a line of any length in bounded memory."""
    number = 0
    with open(path, "rb") as f:
        while (got := read_line(f, limit)) is not None:
            number += 1
            raw, n = got
            if raw is not None and not raw.strip():
                continue
            err = format_error(number, None if raw is None else
                               raw.decode("utf-8", "replace"), n, limit)
            if err is not None:
                return err
    return None


def spool_stdin() -> str:
    """Standard input copied to a temporary file (removed by the caller)."""
    f = tempfile.NamedTemporaryFile(prefix="triptych-batch-", suffix=".jsonl", delete=False)
    with f:
        shutil.copyfileobj(sys.stdin.buffer, f, 1 << 20)
    return f.name


__all__ = ["check_file", "format_error", "spool_stdin"]
