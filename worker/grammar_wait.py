"""GrammarWait: requests parked in a worker until their grammar has compiled.

A structured-output request's grammar compiles on the engine core's compiler threads
(``engine/structured/grammar_compiler.py``), never inside a step: the AddRequest waits here, the
loop keeps stepping the rest of the batch, and the worker's housekeeping admits the
request once its compile is done (a cache hit when the grammar was seen before: no wait).
"""
from __future__ import annotations

from concurrent.futures import Future
from typing import Any


class GrammarWait:
    """request id -> (future of its compile, what to admit it with)."""

    def __init__(self) -> None:
        self._waiting: dict[str, tuple[Future, Any, Any]] = {}

    def __len__(self) -> int:
        return len(self._waiting)

    def park(self, request_id: str, fut: Future, msg: Any, items: Any) -> bool:
        """Hold the request while ``fut`` runs; False (not held) when it is done already."""
        if fut.done():
            return False
        self._waiting[request_id] = (fut, msg, items)
        return True

    def cancel(self, request_id: str) -> None:
        self._waiting.pop(request_id, None)

    def ready(self) -> list[tuple[Any, Any, str | None]]:
        """(msg, items, error or None) of the requests whose compile finished."""
        out = []
        for rid, (fut, msg, items) in list(self._waiting.items()):
            if fut.done():
                del self._waiting[rid]
                err = fut.exception()
                out.append((msg, items, None if err is None else str(err)))
        return out
