"""P0's event loop is shared by every request: a coroutine draining a backlog (the intake's
piled-up step outputs, a whole answer's deltas) must give the loop back while it works
(router/turns.py). Awaiting a queue that holds items does not yield by itself: without
turns, another task would not run until the whole backlog is drained."""
from __future__ import annotations

import asyncio
import time

from triptych.router.turns import Turns


async def _drain(q: asyncio.Queue, turns: Turns | None, per_item_s: float) -> None:
    while not q.empty():
        await q.get()
        end = time.perf_counter() + per_item_s
        while time.perf_counter() < end:  # the item's work
            pass
        if turns is not None:
            await turns.take()


def _others_ran_during(turns: Turns | None) -> int:
    async def main() -> int:
        q: asyncio.Queue = asyncio.Queue()
        for i in range(40):
            q.put_nowait(i)
        ticks = 0

        async def other() -> None:  # another request's handler, wanting the loop
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        task = asyncio.ensure_future(other())
        await asyncio.sleep(0)  # (it has started)
        before = ticks
        await _drain(q, turns, 0.001)  # 40 items of 1 ms: 40 ms of backlog
        during = ticks - before
        task.cancel()
        return during

    return asyncio.run(main())


def test_a_backlog_drained_in_turns_lets_other_tasks_run():
    assert _others_ran_during(None) == 0  # the behaviour turns exist for
    # 40 ms of work at a 5 ms budget: the loop comes back about every 5 items
    assert _others_ran_during(Turns(0.005)) >= 4


def test_turns_yield_only_after_their_budget():
    async def main() -> int:
        turns, yields = Turns(10.0), 0
        loop = asyncio.get_running_loop()
        marker = loop.create_future()
        loop.call_soon(marker.set_result, None)
        for _ in range(100):
            await turns.take()
            yields += marker.done()
        return yields

    assert asyncio.run(main()) == 0  # never yielded: the scheduled callback never ran
