"""Which worker of a pool takes a request: the least work once it is added, prefix-aware.

Each worker has a ``PrefixIndex``: the block hashes of the prompts the router recently sent
it, a stand-in for its prefix cache (bounded by that cache's block count, oldest forgotten
first). A request costs a worker the tokens it still has to compute there: its prompt
minus the leading blocks that worker probably holds. The router picks the worker whose
queued tokens plus that cost is lowest:

    work(w) = queued tokens(w) + prompt tokens - cached prefix tokens(w)

So turn N+1 of a long image conversation (thousands of cached tokens) goes back to the
worker holding turn N, while requests that only share a short chat-template prefix spread
over idle workers. On a decode worker of the P/D layout the same saving is KV that need not
be transferred.
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


def pick(workers: Sequence[W], loads: Sequence[int], cached_tokens: Sequence[int]) -> W:
    """The worker with the least queued work once the request is added (queued tokens
    minus the tokens of the request it already caches); ties go to the less loaded one."""
    assert workers and len(workers) == len(loads) == len(cached_tokens)
    best = min(range(len(workers)), key=lambda i: (loads[i] - cached_tokens[i], loads[i], i))
    return workers[best]
