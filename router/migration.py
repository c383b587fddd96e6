"""Migration: how attempts start, end, run again elsewhere, or fail the request.

When a worker a child depends on dies (or a transfer fails), the child runs again on live
workers from the tokens already streamed (greedy outputs equal an undisturbed run): its
attempt ends and a new one starts, under a new core id. A child whose workers died
MAX_MIGRATIONS times is failed instead: it may be what kills them. Some new attempts are
not migrations (a processor-cache miss, a decode worker handing a preempted request back):
they do not count.

Only the first of several failures reported for one attempt starts another: the attempt is
ended before anything is awaited, and an ended attempt is never run again.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import Callable, Coroutine
from typing import Any

from triptych.router.dispatch import Dispatcher
from triptych.router.errors import EngineDeadError, Retry
from triptych.router.handle import WorkerHandle
from triptych.router.pixel_planner import PixelPlanner
from triptych.router.requests import Attempt, Child, RequestTable
from triptych.router.sockets import RouterSockets
from triptych.worker import wire

logger = logging.getLogger("triptych.router")
MAX_MIGRATIONS = 2


class Migration:
    def __init__(self, table: RequestTable, dispatcher: Dispatcher, sockets: RouterSockets,
                 pixels: PixelPlanner, streamed: Callable[[str], list[int]]) -> None:
        self.table = table
        self.dispatcher = dispatcher
        self.sockets = sockets
        self.pixels = pixels
        self.streamed = streamed  # child id -> tokens streamed so far (for the log)
        self.migrations_total = 0
        self._tasks: set[asyncio.Task] = set()  # NOTE: held so none is collected mid-run

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        t = asyncio.ensure_future(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    # -- an attempt's life --------------------------------------------------------------------
    def start(self, c: Child) -> None:
        """Start a new attempt of ``c``."""
        self._spawn(self._run(self.table.start_attempt(c)))

    async def _run(self, a: Attempt) -> None:
        if a.ended:  # ended before this task ran (the client left): nothing was sent
            return
        try:
            await self.dispatcher.run(a)
        except Retry as e:
            self.retry(a, str(e))
        except (EngineDeadError, ValueError) as e:  # no live worker / a value the wire
            if not a.ended:  # refuses (the request's fault)
                self.fail(a.child, e)
        except Exception:  # our bug: log it, end this request only
            logger.exception("running %s failed", a.core_id)
            if not a.ended:
                self.fail(a.child, EngineDeadError("internal error"))

    def end(self, a: Attempt, abort: list[WorkerHandle] | None = None) -> None:
        """End an attempt; ask the workers that held it (``abort``: only these) to drop it."""
        held = self.table.end(a)
        targets = held if abort is None else [w for w in abort if w in held]
        if targets:
            self._spawn(self._abort(targets, [a.core_id]))

    def abort_orphans(self, w: WorkerHandle, core_ids: list[str]) -> None:
        """``w`` runs requests no live attempt owns (one ended while its AddRequest was on
        its way, behind the abort): stop them there."""
        self._spawn(self._abort([w], core_ids))

    async def _abort(self, workers: list[WorkerHandle], core_ids: list[str]) -> None:
        for w in workers:
            if w.up:
                await self.sockets.send(w, wire.AbortRequest(core_ids))

    def finish(self, c: Child, abort: list[WorkerHandle] | None = None) -> None:
        """The child is done (finished, stopped, failed, aborted): no attempt follows."""
        c.done = True
        if c.attempt is not None:
            self.end(c.attempt, abort)

    # -- going again, or giving up --------------------------------------------------------------
    def retry(self, a: Attempt, reason: str, count: bool = True) -> None:
        """Run ``a``'s child again on live workers, from the tokens it already streamed.
        ``count``: a migration (a worker failed it), limited to MAX_MIGRATIONS."""
        c = a.child
        if a.ended or c.done or c.parent.request_id not in self.table.requests:
            return
        self.end(a)
        if count:
            if c.migrations >= MAX_MIGRATIONS:
                self.fail(c, EngineDeadError(
                    "the request's workers failed repeatedly; it was stopped"))
                return
            c.migrations += 1
            self.migrations_total += 1
        logger.warning("running %s again (%s) after %d streamed tokens", c.child_id, reason,
                       len(self.streamed(c.child_id)))
        self.start(c)

    def fail(self, c: Child, err: Exception) -> None:
        """End the client request: one child failing fails it (its siblings are freed)."""
        request = c.parent
        for sib in request.children:
            if not sib.done:
                self.finish(sib)
        if request.request_id in self.table.requests:
            request.queue.put_nowait(err)

    def encode_again(self, a: Attempt, target: WorkerHandle, hashes: list[str]) -> None:
        """``target`` lost embeddings it was expected to hold (NeedEmbeddings): have an
        encode worker send them again."""
        async def run() -> None:
            try:
                await self.dispatcher.encode(a, target, hashes)
            except (Retry, EngineDeadError) as e:
                self.retry(a, str(e))

        self._spawn(run())

    def on_worker_exit(self, w: WorkerHandle) -> None:
        """A worker died: it restarts with empty caches; every attempt it held runs again
        (or fails its request)."""
        w.forget_caches()
        self._spawn(self.pixels.reset(w))  # its processor-cache store restarts empty
        from triptych.connector import cleanup_stale
        cleanup_stale()  # the dead worker's shared-memory segments and socket dir
        for a in self.table.on(w):
            self.retry(a, f"{w.name} died")
