"""Bounded concurrency with results in input order, over an input of any length.

``ordered_map`` pulls items from an async iterator only when there is room, runs at most
``concurrency`` of them at once, and yields results in the order the items came. At most
``window`` items are held at any time (running, or finished and waiting for an earlier
one), so memory does not grow with the input; the window is wider than the concurrency so
one slow item at the head does not idle the others.
"""
from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterable, AsyncIterator, Awaitable, Callable
from typing import TypeVar

T = TypeVar("T")
R = TypeVar("R")


async def ordered_map(items: AsyncIterable[T], fn: Callable[[T], Awaitable[R]],
                      concurrency: int, window: int | None = None
                      ) -> AsyncIterator[tuple[T, R]]:
    """``(item, await fn(item))`` for each item, in input order; at most ``concurrency``
    calls of ``fn`` run at once and at most ``window`` (default ``4 * concurrency``) items
    are held. ``fn`` should turn its own failures into results: an exception it raises
    ends the iteration (the other calls are cancelled)."""
    if concurrency < 1:
        raise ValueError("concurrency must be at least 1")
    window = max(window or 4 * concurrency, concurrency)
    gate = asyncio.Semaphore(concurrency)

    async def run(item: T) -> R:
        async with gate:
            return await fn(item)

    source = items.__aiter__()
    pending: deque[tuple[T, asyncio.Task[R]]] = deque()
    exhausted = False
    try:
        while True:
            while not exhausted and len(pending) < window:
                try:
                    item = await source.__anext__()
                except StopAsyncIteration:
                    exhausted = True
                    break
                pending.append((item, asyncio.ensure_future(run(item))))
            if not pending:
                return
            item, task = pending.popleft()
            yield item, await task
    finally:  # (an early exit, Ctrl-C, or a failure: nothing keeps running behind us)
        for _, t in pending:
            t.cancel()
        await asyncio.gather(*(t for _, t in pending), return_exceptions=True)
        # Close the source now, while what its own cleanup needs (a PDF reader's thread)
        # still exists, rather than whenever the loop finalizes it.
        close = getattr(source, "aclose", None)
        if close is not None:
            await close()


__all__ = ["ordered_map"]
