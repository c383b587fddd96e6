"""RouterThread: the router on its own event loop thread, for synchronous callers.

The offline ``LLM`` uses it when the knobs ask for worker processes (pools, or colocated
replicas): requests go to the same router and workers as ``triptych serve``'s. The worker
processes are started from this thread, so they exit with it (parent-death signal).

Dropping the last reference frees it as ``close()`` does (``del llm`` in a notebook, as
vLLM's users free an engine): a ``weakref.finalize`` holds the loop, its thread and the
router, never the RouterThread itself, and also runs at interpreter exit.
"""
from __future__ import annotations

import asyncio
import logging
import threading
import weakref
from collections.abc import Callable, Coroutine
from typing import Any, TypeVar

from triptych.router.prompt import ProcessedPrompt
from triptych.router.router import Router
from triptych.config import EngineConfig
from triptych.engine.outputs import RequestOutput
from triptych.engine.sample.sampling_params import SamplingParams

T = TypeVar("T")


class RouterThread:
    def __init__(self, config: EngineConfig, tokenizer: Any, processor: Any | None = None
                 ) -> None:
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True,
                                        name="triptych-router")
        self._thread.start()
        self._closed = False
        try:
            self.router = Router(config, tokenizer, processor=processor)
            self._call(self.router.start())
        except BaseException:
            # NOTE: a failed start leaves nothing: workers, Ray actors and placement
            # groups, sockets (their auth thread), the run dir
            try:
                if hasattr(self, "router"):
                    self._call(self.router.shutdown())
            except Exception:  # noqa: BLE001 - the start's own error is the one to raise
                logging.getLogger("triptych.router").exception("cleaning up a failed start")
            finally:
                self._stop_loop()
            raise
        self._finalizer = weakref.finalize(self, _shut_down, self._loop, self._thread,
                                           self.router)

    def _call(self, coro: Coroutine[Any, Any, T]) -> T:
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result()
        except BaseException:
            # NOTE: Ctrl-C (KeyboardInterrupt) in the caller's thread: cancel the work on
            # the router's loop too, so its requests are aborted in the workers rather than
            # left running for nobody.
            fut.cancel()
            raise

    def run(self, requests: list[tuple[str, ProcessedPrompt, SamplingParams]],
            on_done: Callable[[RequestOutput], None] | None = None) -> list[RequestOutput]:
        """Run every request through the pools at once; outputs in the order given. The
        first error (a refused request, no live worker) aborts the rest and is raised."""
        async def one(rid: str, prompt: ProcessedPrompt, sp: SamplingParams) -> RequestOutput:
            last = None
            async for out in self.router.outputs_of(rid, prompt, sp, stream=False):
                last = out
            assert last is not None and last.finished
            if on_done is not None:
                on_done(last)
            return last

        async def all_() -> list[RequestOutput]:
            tasks = [asyncio.ensure_future(one(*r)) for r in requests]
            try:
                return list(await asyncio.gather(*tasks))
            except BaseException:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
                raise

        return self._call(all_())

    def stats(self) -> dict[str, float]:
        return self.router.stats()

    def close(self) -> None:
        """Stop every worker process and the loop (idempotent; also when garbage-collected
        and at interpreter exit)."""
        self._closed = True
        self._finalizer()

    def _stop_loop(self) -> None:
        _stop(self._loop, self._thread)


def _stop(loop: asyncio.AbstractEventLoop, thread: threading.Thread) -> None:
    loop.call_soon_threadsafe(loop.stop)
    if thread is not threading.current_thread():
        thread.join(10)


def _shut_down(loop: asyncio.AbstractEventLoop, thread: threading.Thread, router: Router
               ) -> None:
    """The router's shutdown on its loop, then the loop's end (the finalizer: it must not
    hold the RouterThread)."""
    if thread is threading.current_thread():
        # NOTE: collected on the loop's own thread (a gc pass there): it cannot wait for
        # itself, so the shutdown is scheduled and the loop stops once it is done.
        async def then_stop() -> None:
            try:
                await router.shutdown()
            finally:
                loop.stop()

        loop.create_task(then_stop())
        return
    try:
        asyncio.run_coroutine_threadsafe(router.shutdown(), loop).result()
    finally:
        _stop(loop, thread)
