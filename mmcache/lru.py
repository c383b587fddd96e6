"""The key-replicated LRU processor cache (``mm_processor_cache_type="lru"``).

P0 keeps one ``ProcessorCacheMirror`` per consumer worker (keys and sizes); the worker (P1)
keeps a ``ProcessorCacheStore`` (keys and tensors). A hit on P0 sends only the key.

Every decision is taken in ONE place, P0's ``plan()``, and travels with the message:

    P0  plan(items) -> ops ["ref" | "data" | "data-uncached"] + evicted keys
        ... message(evicted, items with ops, pixels of the data items) ...
    P1  apply(evicted, items): drop evicted keys, store "data", resolve "ref"

so P1 never evicts by itself and the two sides cannot drift apart the way mirrored LRUs
did in vLLM #31404, as long as the rules below hold.

NOTE (rules for whoever wires these into messages):
- ``plan()`` is called in exactly the order the messages are delivered to that worker on
  an ordered channel: hold the lock that sends while planning and sending. Items P0 has no
  pixels for are flagged (``have_data``); a plan that would need them returns ``need_data``
  without changing anything, so nothing slow (decoding, the HF processor) runs under the lock.
- Every planned message is applied by the worker, even when its request was aborted in
  the meantime (apply the cache part, then drop the request). A request aborted before it
  was planned costs nothing.
- When the worker raises ``ProcessorCacheMiss(keys)`` (a cleared worker, a bug), P0 calls
  ``forget(keys, seq)`` with the ``seq`` of the plan that missed (keep it with the request,
  or let it travel and come back) and re-sends the request; ``forget`` leaves alone a key
  that a later plan already sent again as "data" (that message will store it, and forgetting
  it would leave P1 holding a key P0 can never evict). A restarted worker (in-flight
  messages lost, empty store) means ``forget_all()``, under the send lock, before anything is
  sent to the new process. The worker never dies of a miss.
"""
from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import torch

REF = "ref"  # P1 holds the key: only the key travels
DATA = "data"  # pixels travel; P1 stores them under the key
DATA_UNCACHED = "data-uncached"  # pixels travel; P1 must not store them
OPS = (REF, DATA, DATA_UNCACHED)


class ProcessorCacheMiss(Exception):
    """A worker was told to reuse items it does not hold. Retryable: P0 ``forget``s the
    keys and sends the pixels again."""

    def __init__(self, keys: Sequence[str]) -> None:
        self.keys = list(keys)
        super().__init__(f"processor cache miss for {len(self.keys)} item(s): "
                         f"{', '.join(k[:12] for k in self.keys)}")


@dataclass
class CachePlan:
    seq: int = 0  # this plan's number (1, 2, ...): what ``forget`` needs after a miss
    ops: list[str] = field(default_factory=list)  # one per item, in message order
    evicted: list[str] = field(default_factory=list)  # keys P1 drops before applying ops
    # Items given without pixels that the worker does not hold: when set, nothing was
    # planned or changed (seq 0); produce their pixels and plan again.
    need_data: list[int] = field(default_factory=list)


class ProcessorCacheMirror:
    """P0's record of what one worker holds. Thread-safe (one internal lock); see the
    module NOTE for the ordering rule."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError("capacity_bytes must be >= 0")
        self.capacity_bytes = capacity_bytes
        # key -> (bytes, seq of the plan that last sent its data), least recently used first
        self._entries: OrderedDict[str, tuple[int, int]] = OrderedDict()
        self._lock = threading.Lock()
        self._seq = 0
        self.num_bytes = 0

    def __len__(self) -> int:
        return len(self._entries)

    def holds(self, key: str) -> bool:
        return key in self._entries

    def keys(self) -> list[str]:
        """Keys from least to most recently used."""
        with self._lock:
            return list(self._entries)

    def plan(self, items: Sequence[tuple[str, int]],
             have_data: Sequence[bool] | None = None) -> CachePlan:
        """Decide, for one message's items ``(key, nbytes)`` in order, what travels.

        Hits become refs (and most recently used); misses become "data" after evicting
        least recently used keys that this message does not use; an item that cannot fit
        (larger than the cache, or the room is held by this message's own items) is sent
        as "data-uncached" and not remembered.

        ``have_data[i]`` False: P0 has no pixels for item i (a processor-cache hit). If the
        worker does not hold it either, the plan comes back with ``need_data`` and changes
        nothing, so the caller can release the send lock, produce the pixels
        (``InputProcessor.load_pixels``) and plan again; a held item stays a ref, because a
        plan never evicts keys of its own message.
        """
        in_message = {key for key, _ in items}
        with self._lock:
            if have_data is not None:
                need = [i for i, ((key, _), have) in enumerate(zip(items, have_data, strict=True))
                        if not have and key not in self._entries]
                if need:
                    return CachePlan(need_data=need)
            self._seq += 1
            out = CachePlan(self._seq)
            for key, nbytes in items:
                if type(nbytes) is not int or nbytes < 0:
                    raise ValueError(f"bad item size {nbytes!r}")
                if key in self._entries:
                    self._entries.move_to_end(key)
                    out.ops.append(REF)
                    continue
                victims = self._victims(nbytes, in_message)
                if victims is None:
                    out.ops.append(DATA_UNCACHED)
                    continue
                for k in victims:
                    self.num_bytes -= self._entries.pop(k)[0]
                out.evicted += victims
                self._entries[key] = (nbytes, self._seq)
                self.num_bytes += nbytes
                out.ops.append(DATA)
        return out

    def _victims(self, nbytes: int, keep: set[str]) -> list[str] | None:
        """LRU keys (not in ``keep``) whose removal makes room for ``nbytes``; None if
        no such set exists."""
        excess = self.num_bytes + nbytes - self.capacity_bytes
        if nbytes > self.capacity_bytes:
            return None
        victims: list[str] = []
        for key, (size, _) in self._entries.items():
            if excess <= 0:
                break
            if key not in keep:
                victims.append(key)
                excess -= size
        return victims if excess <= 0 else None

    def forget(self, keys: Sequence[str], seq: int) -> None:
        """The worker reported ``keys`` missing while applying plan ``seq``: stop referring
        to them, unless a later plan has sent their data again."""
        with self._lock:
            for key in keys:
                entry = self._entries.get(key)
                if entry is not None and entry[1] <= seq:
                    del self._entries[key]
                    self.num_bytes -= entry[0]

    def forget_all(self) -> None:
        """The worker restarted with an empty store."""
        with self._lock:
            self._entries.clear()
            self.num_bytes = 0

    def check_integrity(self) -> None:
        with self._lock:
            assert self.num_bytes == sum(n for n, _ in self._entries.values()) \
                <= self.capacity_bytes


class StoreItem(NamedTuple):
    """One item of a message, as P1 sees it."""

    key: str  # mm hash
    op: str  # REF | DATA | DATA_UNCACHED
    data: torch.Tensor | None = None  # the pixels of DATA / DATA_UNCACHED items
    spec: tuple[torch.dtype, tuple[int, ...]] | None = None  # expected (dtype, shape) of a REF


class ProcessorCacheStore:
    """P1's side: tensors by key, changed only as P0's plans say. One thread at a time."""

    def __init__(self, capacity_bytes: int) -> None:
        if capacity_bytes < 0:
            raise ValueError("capacity_bytes must be >= 0")
        self.capacity_bytes = capacity_bytes
        self._entries: dict[str, torch.Tensor] = {}
        self.num_bytes = 0
        self.num_refs = 0  # refs resolved (hits)
        self.num_misses = 0  # refs not resolved (ProcessorCacheMiss)
        self.num_refused = 0  # "data" not stored because P0's plan would break the byte cap

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def keys(self) -> set[str]:
        return set(self._entries)

    def apply(self, evicted: Sequence[str], items: Sequence[StoreItem]) -> list[torch.Tensor]:
        """Apply one message: drop ``evicted``, store DATA items, resolve REFs; the pixels
        of every item, in order.

        Raises ``ProcessorCacheMiss`` listing every REF it could not resolve, *after* the
        evictions and stores are applied (so P1 is then exactly what P0 planned, minus those
        keys, which P0 ``forget``s). A malformed message raises ValueError before any change.
        """
        for it in items:
            if it.op not in OPS:
                raise ValueError(f"unknown processor cache op {it.op!r}")
            if (it.op == REF) != (it.data is None):
                raise ValueError(f"{it.op} item {it.key[:12]} {'has' if it.op == REF else 'lacks'}"
                                 " pixel data")
        for key in evicted:
            self._drop(key)
        out: list[torch.Tensor] = []
        missing: list[str] = []
        for it in items:
            if it.op == REF:
                t = self._entries.get(it.key)
                if t is not None and it.spec is not None and (t.dtype, tuple(t.shape)) != \
                        (it.spec[0], tuple(it.spec[1])):
                    self._drop(it.key)  # the key names other content than P0 thinks
                    t = None
                if t is None:
                    missing.append(it.key)
                    continue
                self.num_refs += 1
                out.append(t)
                continue
            assert it.data is not None
            if it.op == DATA:
                self._store(it.key, it.data)
            out.append(it.data)
        if missing:
            self.num_misses += len(missing)
            raise ProcessorCacheMiss(missing)
        return out

    def _store(self, key: str, t: torch.Tensor) -> None:
        self._drop(key)  # a re-sent key replaces what was there
        size = t.numel() * t.element_size()
        if self.num_bytes + size > self.capacity_bytes:
            # NOTE: cannot happen while P0 and P1 agree on sizes; if it does, keep the cap
            # and let a later ref miss (recoverable) rather than grow without bound.
            self.num_refused += 1
            return
        self._entries[key] = t
        self.num_bytes += size

    def _drop(self, key: str) -> None:
        t = self._entries.pop(key, None)
        if t is not None:
            self.num_bytes -= t.numel() * t.element_size()

    def clear(self) -> None:
        self._entries.clear()
        self.num_bytes = 0

    def check_integrity(self) -> None:
        assert self.num_bytes == sum(t.numel() * t.element_size()
                                     for t in self._entries.values()) <= self.capacity_bytes
