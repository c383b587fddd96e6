"""Turns on P0's event loop: a loop that drains a backlog gives the loop back now and then.

Awaiting a socket or queue that already holds data does not yield to the event loop: a
coroutine that drains a backlog (a worker's step outputs that piled up while P0 was busy,
a whole answer's deltas) runs it all in one go, and every other request waits. Measured
with n=16 x 1,500 tokens and 20 top logprobs beside a short chat: the intake held the loop
0.2-0.25 s at a time. ``Turns.take()`` after each item yields once ``budget_s`` of work has
passed since the last turn.
"""
from __future__ import annotations

import asyncio
import time

TURN_S = 0.005  # work between two turns of the event loop, at most (about)


class Turns:
    def __init__(self, budget_s: float = TURN_S) -> None:
        self.budget_s = budget_s
        self._since = time.perf_counter()

    async def take(self) -> None:
        """Yield to the event loop if this coroutine has run ``budget_s`` since its last
        turn (or since it was created)."""
        if time.perf_counter() - self._since >= self.budget_s:
            await asyncio.sleep(0)
            self._since = time.perf_counter()


__all__ = ["TURN_S", "Turns"]
