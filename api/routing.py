"""Which worker of a pool takes a request: least outstanding work, prefix-aware.

Each worker has a ``PrefixIndex``: the block hashes of the prompts the router recently sent
it, a stand-in for its prefix cache (bounded by that cache's block count, oldest forgotten
first). A request goes to the worker holding the longest run of its leading blocks, unless
that worker's queued tokens exceed the least-loaded worker's by more than ``slack``; then
load wins. This keeps a conversation's turns (and the n children of a request) on the
worker that already holds their KV, without letting one hot conversation pile work on one
worker while others idle.
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from typing import TypeVar

W = TypeVar("W")


class PrefixIndex:
    def __init__(self, capacity_blocks: int) -> None:
        self.capacity = max(1, capacity_blocks)
        self._hashes: OrderedDict[bytes | str, None] = OrderedDict()

    def match(self, hashes: Sequence[bytes | str]) -> int:
        """Leading blocks of ``hashes`` this worker probably holds."""
        n = 0
        for h in hashes:
            if h not in self._hashes:
                break
            n += 1
        return n

    def record(self, hashes: Sequence[bytes | str]) -> None:
        for h in hashes:
            self._hashes[h] = None
            self._hashes.move_to_end(h)
        while len(self._hashes) > self.capacity:
            self._hashes.popitem(last=False)

    def discard(self, hashes: Sequence[bytes | str]) -> None:
        for h in hashes:
            self._hashes.pop(h, None)

    def clear(self) -> None:
        self._hashes.clear()


def pick(workers: Sequence[W], loads: Sequence[int], matches: Sequence[int], slack: int) -> W:
    """The worker with the longest prefix match among those within ``slack`` queued tokens
    of the least loaded; ties go to the less loaded one."""
    assert workers and len(workers) == len(loads) == len(matches)
    floor = min(loads)
    best = min((i for i in range(len(workers)) if loads[i] <= floor + slack),
               key=lambda i: (-matches[i], loads[i], i))
    return workers[best]
