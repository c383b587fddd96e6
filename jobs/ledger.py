"""Resuming a JSONL output: what an earlier run already wrote, and a half-written last line.

A job writes one JSON line per finished input line, whole lines only, and flushes each; a
crash or a kill can still cut the last line short. ``recover`` reads the file once, line
by line (never all of it), cuts such a tail off, and counts the complete lines per key.
The rerun then skips, for each key, as many input lines with that key as the file holds
(``Ledger.skip``): counting occurrences rather than remembering a set keeps a duplicated
``custom_id`` (whose second line is an error line) exact across a resume too.
"""
from __future__ import annotations

import json
import logging
import os
from collections import Counter
from collections.abc import Callable, Hashable
from typing import Any

logger = logging.getLogger("triptych.jobs")


def key_of(custom_id: Any) -> str:
    """The ledger key of an output line's ``custom_id`` (any JSON value, null included)."""
    return json.dumps(custom_id, sort_keys=True)


def recover(path: str, key: Callable[[dict], Hashable]) -> Counter:
    """Count the complete JSON lines of ``path`` by ``key(line)``; a last line without its
    newline (a write cut short) is removed from the file. A missing file counts nothing."""
    done: Counter = Counter()
    if not os.path.exists(path):
        return done
    good_end = 0  # offset just after the last complete line
    with open(path, "rb+") as f:
        for number, raw in enumerate(f, 1):
            if not raw.endswith(b"\n"):
                break  # the tail of an interrupted write
            good_end += len(raw)
            if not raw.strip():
                continue
            try:
                line = json.loads(raw)
                done[key(line)] += 1
            except (ValueError, TypeError, AttributeError, KeyError):
                logger.warning("%s line %d is not a result line; ignored", path, number)
        size = f.seek(0, os.SEEK_END)
        if size > good_end:
            logger.warning("%s: removing a half-written last line (%d bytes)", path,
                           size - good_end)
            f.truncate(good_end)
    return done


class Ledger:
    """The keys already written, as counts; ``skip(key)`` consumes one."""

    def __init__(self, done: Counter | None = None) -> None:
        self.done: Counter = done if done is not None else Counter()
        self.total = sum(self.done.values())

    def skip(self, key: Hashable) -> bool:
        """True if an earlier run already wrote this occurrence of ``key``."""
        if self.done.get(key, 0) > 0:
            self.done[key] -= 1
            return True
        return False


__all__ = ["Ledger", "key_of", "recover"]
