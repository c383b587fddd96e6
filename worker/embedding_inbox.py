"""EmbeddingInbox: requests that wait for their images' embeddings from the encode pool.

On a worker that prefills (a prefill worker, or a decode worker in the E+PD layout) a
request whose items come without pixels waits here until every item has an embedding:
from this worker's encoder cache, or from an encode worker through the connector. An
embedding is accepted only for a request that is known and needs that mm hash, with the
right shape (a peer cannot fill the cache with embeddings nobody asked for); one that comes
before its request (the encode worker won the race) waits in a small bounded buffer.

    wait(rid, items, admit)      items without embeddings: look up the cache, park the rest
    deliver(hash, tensor)        -> requests now complete (their admit callbacks run)
    expire(now)                  -> request ids that waited too long (their embeddings lost)
"""
from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import torch
from triptych.engine.encoder.encoder_cache import EncoderCache
from triptych.engine.request import MMItem

logger = logging.getLogger("triptych.prefill")
MAX_EARLY = 64  # embeddings held for requests not seen yet


@dataclass
class _Waiting:
    items: list[MMItem]
    admit: Callable[[], None]
    deadline: float

    @property
    def missing(self) -> list[str]:
        return [it.mm_hash for it in self.items if it.embedding is None]


class EmbeddingInbox:
    def __init__(self, cache: EncoderCache, hidden_size: int, dtype: torch.dtype,
                 timeout_s: float) -> None:
        """``hidden_size``: the columns of the model's encoder payload (the contract's
        ``payload_width``: the embedding, plus e.g. DeepStack features)."""
        self.cache = cache
        self.hidden_size, self.dtype = hidden_size, dtype
        self.timeout_s = timeout_s
        self._waiting: dict[str, _Waiting] = {}
        self._early: OrderedDict[str, tuple[torch.Tensor, float]] = OrderedDict()
        self.num_received = 0
        self.num_dropped = 0

    def __len__(self) -> int:
        return len(self._waiting)

    def wait(self, request_id: str, items: list[MMItem], admit: Callable[[], None]) -> list[str]:
        """Park a request until its items have embeddings; ``admit`` runs once they all do
        (at once if nothing is missing). Returns the mm hashes still missing."""
        for it in items:
            if it.pixel_values is not None or it.embedding is not None:
                continue
            emb = self.cache.lookup(it.mm_hash)
            if emb is None and it.mm_hash in self._early:
                emb = self._early.pop(it.mm_hash)[0]
            if emb is not None and emb.shape[0] == it.length:
                it.embedding = emb
        w = _Waiting([it for it in items if it.pixel_values is None],
                     admit, time.monotonic() + self.timeout_s)
        if not w.missing:
            admit()
            return []
        self._waiting[request_id] = w
        return w.missing

    def deliver(self, mm_hash: str, emb: torch.Tensor) -> list[str]:
        """An embedding arrived; returns the ids of requests it completed (admitted)."""
        if emb.dim() != 2 or emb.shape[1] != self.hidden_size:
            self.num_dropped += 1
            logger.warning("dropped an embedding of shape %s (the model's payload is [rows, %d])",
                           tuple(emb.shape), self.hidden_size)
            return []
        emb = emb.to(self.dtype)
        done, used = [], False
        for rid, w in list(self._waiting.items()):
            mine = False
            for it in w.items:
                if it.mm_hash == mm_hash and it.embedding is None and it.length == emb.shape[0]:
                    it.embedding, mine = emb, True
            used |= mine
            if mine and not w.missing:
                del self._waiting[rid]
                w.admit()
                done.append(rid)
        self.num_received += 1
        if used:
            self.cache.put(mm_hash, emb)
        else:  # its request has not come yet (or never will): hold it briefly, bounded
            self._early[mm_hash] = (emb, time.monotonic() + self.timeout_s)
            while len(self._early) > MAX_EARLY:
                self._early.popitem(last=False)
                self.num_dropped += 1
        return done

    def missing(self, request_id: str) -> list[str]:
        w = self._waiting.get(request_id)
        return w.missing if w else []

    def cancel(self, request_id: str) -> bool:
        return self._waiting.pop(request_id, None) is not None

    def expire(self, now: float) -> list[str]:
        """Requests whose embeddings did not come in time (they are dropped here)."""
        late = [rid for rid, w in self._waiting.items() if now > w.deadline]
        for rid in late:
            del self._waiting[rid]
        for h in [h for h, (_, t) in self._early.items() if now > t]:
            del self._early[h]
        return late
