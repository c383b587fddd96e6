"""What `triptych ocr` writes: one file per document, pages in order, with page numbers.

    markdown  <name>.md     ``<!-- page i/n -->`` before each page's text
    text      <name>.txt    ``=== page i/n ===`` before each page's text
    jsonl     <name>.jsonl  one object per page: text, tokens, timings, attempts, error

A document is written to ``<file>.partial`` as its pages arrive and renamed to its final
name only when it succeeded, so a final file always holds a whole document: that is what
``--resume`` takes for "finished" (and what a crash never leaves half-written).
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass
from typing import Any

EXTENSIONS = {"markdown": ".md", "text": ".txt", "jsonl": ".jsonl"}


@dataclass
class PageResult:
    """The outcome of one page's request(s)."""

    text: str = ""
    error: str | None = None
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finish_reason: str | None = None
    attempts: int = 0
    seconds: float = 0.0


def final_path(out_dir: str, name: str, fmt: str) -> str:
    """Where a finished document is written."""
    return os.path.join(out_dir, name + EXTENSIONS[fmt])


def finished(out_dir: str, name: str, fmt: str) -> bool:
    """True when an earlier run wrote this document whole (``--resume`` skips it)."""
    return os.path.isfile(final_path(out_dir, name, fmt))


class DocWriter:
    """Streams one document's pages to its ``.partial`` file; ``finish`` publishes it."""

    def __init__(self, out_dir: str, name: str, fmt: str, source: str) -> None:
        self.fmt, self.source = fmt, source
        self.path = final_path(out_dir, name, fmt)
        self.partial = self.path + ".partial"
        os.makedirs(os.path.dirname(self.path) or ".", exist_ok=True)
        self._f = open(self.partial, "w", encoding="utf-8")  # noqa: SIM115 (until finish)

    def page(self, number: int, total: int, r: PageResult, width: int = 0, height: int = 0
             ) -> None:
        """Append page ``number`` of ``total`` (pages come in order)."""
        try:
            self._write(number, total, r, width, height)
        finally:
            self._f.flush()  # (a long document's progress can be watched in its .partial)

    def _write(self, number: int, total: int, r: PageResult, width: int, height: int
               ) -> None:
        if self.fmt == "jsonl":
            row: dict[str, Any] = {
                "document": self.source, "page": number, "pages": total, "text": r.text,
                "error": r.error, "prompt_tokens": r.prompt_tokens,
                "completion_tokens": r.completion_tokens, "finish_reason": r.finish_reason,
                "attempts": r.attempts, "seconds": round(r.seconds, 4),
                "width": width, "height": height}
            self._f.write(json.dumps(row, ensure_ascii=False) + "\n")
            return
        body = r.text if r.error is None else ""
        if self.fmt == "markdown":
            note = f": failed: {r.error}" if r.error else ""
            self._f.write(f"{'' if number == 1 else chr(10)}<!-- page {number}/{total}"
                          f"{note} -->\n\n{body.strip()}\n")
        else:
            note = f" (failed: {r.error})" if r.error else ""
            self._f.write(f"{'' if number == 1 else chr(10)}=== page {number}/{total}{note} "
                          f"===\n{body.strip()}\n")

    def finish(self) -> str:
        """Close and publish the document under its final name (atomic rename)."""
        self._f.close()
        os.replace(self.partial, self.path)
        return self.path

    def discard(self) -> None:
        """Close and remove the partial file (a failed document has no output)."""
        self._f.close()
        try:
            os.unlink(self.partial)
        except FileNotFoundError:
            pass


__all__ = ["EXTENSIONS", "DocWriter", "PageResult", "final_path", "finished"]
