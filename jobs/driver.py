"""Bounded concurrency with results in input order, over an input of any length.

``ordered_map`` pulls items from an async iterator only when there is room, runs at most
``concurrency`` of them at once, and yields results in the order the items came. At most
``window`` items are held at any time (running, or finished and waiting for an earlier
one), and, given their sizes, items of at most ``max_bytes`` bytes (plus the one that
crossed that line), so memory does not grow with the input however long it is or however
big its items; the window is wider than the concurrency so one slow item at the head does
not idle the others.
"""
from __future__ import annotations

import asyncio
import signal
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

T = TypeVar("T")
R = TypeVar("R")


class CtrlC:
    """Ctrl-C for a job's event loop that no awaited call can swallow. ``asyncio.run`` turns
    SIGINT into one cancellation of the main task, and that cancellation is lost when it
    reaches a call that answers anyway (the in-process app turns a cancelled request into
    a response): the job then runs to its end and exits 0. Here the signal is remembered:
    ``check()`` (between results) and the end of the block raise KeyboardInterrupt."""

    def __init__(self) -> None:
        self.hit = False
        self._loop: asyncio.AbstractEventLoop | None = None

    async def __aenter__(self) -> "CtrlC":
        loop, main = asyncio.get_running_loop(), asyncio.current_task()

        def on_sigint() -> None:
            self.hit = True
            if main is not None:
                main.cancel()

        try:
            loop.add_signal_handler(signal.SIGINT, on_sigint)
            self._loop = loop
        except (NotImplementedError, RuntimeError, ValueError):  # not the main thread
            self._loop = None
        return self

    async def __aexit__(self, et: Any, e: Any, tb: Any) -> bool:
        if self._loop is not None:
            self._loop.remove_signal_handler(signal.SIGINT)
        if self.hit and (et is None or issubclass(et, asyncio.CancelledError)):
            raise KeyboardInterrupt
        return False

    def check(self) -> None:
        if self.hit:
            raise KeyboardInterrupt


async def ordered_map(items: AsyncIterable[T], fn: Callable[[T], Awaitable[R]],
                      concurrency: int, window: int | None = None,
                      size: Callable[[T], int] | None = None, max_bytes: int | None = None
                      ) -> AsyncIterator[tuple[T, R]]:
    """``(item, await fn(item))`` for each item, in input order; at most ``concurrency``
    calls of ``fn`` run at once and at most ``window`` (default ``4 * concurrency``) items
    are held. With ``size`` (an item's bytes) and ``max_bytes``, no further item is pulled
    while the held items' bytes reach ``max_bytes`` (one item is always let in, so the
    held bytes stay below ``max_bytes`` plus one item's). ``fn`` should turn its own
    failures into results: an exception it raises ends the iteration (the other calls are
    cancelled)."""
    if concurrency < 1:
        raise ValueError("concurrency must be at least 1")
    window = max(window or 4 * concurrency, concurrency)
    gate = asyncio.Semaphore(concurrency)

    async def run(item: T) -> R:
        async with gate:
            return await fn(item)

    def room(held: int) -> bool:
        return len(pending) < window and (max_bytes is None or held < max_bytes)

    source = items.__aiter__()
    pending: deque[tuple[T, asyncio.Task[R], int]] = deque()
    held, exhausted = 0, False  # held: the pending items' bytes
    try:
        while True:
            while not exhausted and (not pending or room(held)):
                try:
                    item = await source.__anext__()
                except StopAsyncIteration:
                    exhausted = True
                    break
                nbytes = size(item) if size is not None else 0
                held += nbytes
                pending.append((item, asyncio.ensure_future(run(item)), nbytes))
            if not pending:
                return
            item, task, nbytes = pending.popleft()
            held -= nbytes
            yield item, await task
    finally:  # (an early exit, Ctrl-C, or a failure: nothing keeps running behind us)
        for _, t, _ in pending:
            t.cancel()
        await asyncio.gather(*(t for _, t, _ in pending), return_exceptions=True)
        # Close the source now, while what its own cleanup needs (a PDF reader's thread)
        # still exists, rather than whenever the loop finalizes it.
        close = getattr(source, "aclose", None)
        if close is not None:
            await close()


__all__ = ["ordered_map"]
