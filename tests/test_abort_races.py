"""A client that leaves the moment its first token lands still has its request aborted.

The server aborts a request by cancelling the task that reads it (api/serving.py); the
router's wait for the first token must let that cancellation through. Python 3.11's
``asyncio.wait_for`` returns the result instead when the inner wait has just finished, and
the request then ran to its end with nobody reading it (seen under 200 clients that gave up
at once: a dozen ran on). Checked here at every loop turn around the first output, on a
real (unstarted) Router.
"""
from __future__ import annotations

import asyncio
import contextlib

import pytest


@pytest.fixture(scope="module")
def router(tiny_qwen2_vl):
    from transformers import AutoTokenizer
    from triptych.config import EngineConfig
    from triptych.router.router import Router

    return Router(EngineConfig(model=tiny_qwen2_vl),
                  AutoTokenizer.from_pretrained(tiny_qwen2_vl))


async def _leave_after(router, turns: int) -> tuple[bool, bool, bool]:
    """Cancel the reader ``turns`` loop turns after the first output is released: (the
    cancel found it running, it ended cancelled, the stream was closed)."""
    released, closed = asyncio.Event(), []

    async def outputs():
        try:
            await released.wait()
            yield "first token"
            await asyncio.Event().wait()  # the rest of a long answer
        finally:
            closed.append(True)

    async def reader() -> str | None:
        async with contextlib.aclosing(outputs()) as outs:
            return await router._first_output(outs)

    task = asyncio.ensure_future(reader())
    for _ in range(3):
        await asyncio.sleep(0)  # it waits for the first output
    released.set()
    for _ in range(turns):
        await asyncio.sleep(0)
    asked = task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await asyncio.wait_for(task, 30)  # a hang guard
    return asked, task.cancelled(), bool(closed)


def test_a_cancel_that_meets_the_first_token_is_never_swallowed(router):
    async def run() -> list[tuple[bool, bool, bool]]:
        return [await _leave_after(router, turns) for turns in range(8)]

    seen = asyncio.run(run())
    met = [s for s in seen if s[0]]  # the cancel arrived while the reader still ran
    assert met, seen
    assert all(cancelled and closed for _, cancelled, closed in met), seen
