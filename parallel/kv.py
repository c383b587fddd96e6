"""Rank to rank KV between tensor-parallel groups of the same size (P+D with TP).

Each rank of a group holds the same KV heads as the rank of the same number in another
group of the same size, so a prefill group's rank r sends its slice straight to the decode
group's rank r; nothing passes through rank 0:

    prefill rank 0 (KVSender)   SendKV to ranks 1..N-1 (each sends a KVSlice to its peer),
                                then its own heads with the KVTransfer header (sliced=True)
    decode rank 0 (KVReceiver)  checks the header against its reservation, RecvKV to ranks
                                1..N-1 (each takes its slice, checks it, writes it into the
                                reserved blocks), writes its own heads

Rank 0 collects one ok flag per rank (a gather), so a slice that did not arrive (or did
not fit) fails that transfer alone; the group stays in step. ``RankKV`` is a rank's end.
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from typing import Any

import torch
from triptych.worker import wire

logger = logging.getLogger("triptych.tp")
MAX_WAITING = 256  # slices held for transfers rank 0 has not asked about yet


class RankKV:
    """A rank's data endpoint: sends its slices, takes the slices sent to it."""

    def __init__(self, kind: str, name: str, rank: int, keys: Any = None,
                 bind_host: str = "127.0.0.1") -> None:
        from triptych.connector import make_connector

        self.rank = rank
        self.connector = make_connector(kind, name=name, header_type=wire.KVSlice, keys=keys,
                                        bind_host=bind_host)
        self._waiting: OrderedDict[tuple[str, int], torch.Tensor] = OrderedDict()

    @property
    def address(self) -> str:
        return self.connector.address

    def send(self, peer: str, request_id: str, first_block: int, data: torch.Tensor) -> bool:
        from triptych.connector import ConnectorError
        try:
            self.connector.send(peer, wire.KVSlice(request_id, first_block, self.rank),
                                [data.contiguous().cpu()])
            return True
        except ConnectorError as e:
            logger.error("rank %d: sending a KV slice of %s failed: %s", self.rank, request_id, e)
            return False

    def take(self, request_id: str, first_block: int, timeout_s: float) -> torch.Tensor | None:
        """The slice for (request, first block), waiting up to ``timeout_s`` for it."""
        from triptych.connector import BadMessage

        key = (request_id, first_block)
        deadline = time.monotonic() + timeout_s
        while key not in self._waiting:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            try:
                got = self.connector.recv(int(left * 1000) + 1)
            except BadMessage as e:
                logger.warning("rank %d dropped a bad KV slice: %s", self.rank, e)
                continue
            if got is None:
                continue
            h = got.header
            if h.rank != self.rank or len(got.tensors) != 1:
                logger.warning("rank %d dropped a KV slice meant for rank %d", self.rank, h.rank)
                continue
            self._waiting[(h.request_id, h.first_block)] = got.tensors[0]
            while len(self._waiting) > MAX_WAITING:  # slices nobody asked for: the oldest go
                self._waiting.popitem(last=False)
        return self._waiting.pop(key)

    def close(self) -> None:
        self.connector.close()
