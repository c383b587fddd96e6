"""EncoderCache: vision embeddings by mm hash, so a repeated image skips the tower.

Bounded in bytes (``encoder_cache_size``, e.g. '256MiB'; 0 disables it). Entries a step or
a request still uses are pinned by reference count (``acquire`` / ``release``) and never
evicted; among the unpinned ones the least recently used go first. An entry that cannot fit
(larger than the cache, or the room is pinned) is simply not stored: the caller keeps the
tensor it has and the next use encodes again.

In the pool layout the prefill side receives embeddings from encode workers and inserts
them with ``put_external``. Used by one thread (the worker loop).
"""
from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable

import torch

from triptych.config import parse_size


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class EncoderCache:
    def __init__(self, capacity: int | str) -> None:
        """``capacity``: bytes, or a size string such as '512MiB'."""
        self.capacity_bytes = parse_size(capacity)
        if self.capacity_bytes < 0:
            raise ValueError("encoder cache size must be >= 0")
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()  # LRU first
        self._refs: dict[str, int] = {}  # pinned keys -> users
        self.num_bytes = 0  # bytes of the embeddings held
        self.num_queries = 0  # items looked up
        self.num_hits = 0  # of which found

    def __contains__(self, mm_hash: str) -> bool:
        return mm_hash in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, mm_hash: str) -> torch.Tensor | None:
        """Uncounted lookup; a hit becomes the most recently used entry."""
        emb = self._entries.get(mm_hash)
        if emb is not None:
            self._entries.move_to_end(mm_hash)
        return emb

    def lookup(self, mm_hash: str) -> torch.Tensor | None:
        """``get``, counted in ``num_queries`` / ``num_hits``."""
        self.num_queries += 1
        emb = self.get(mm_hash)
        self.num_hits += emb is not None
        return emb

    def put(self, mm_hash: str, emb: torch.Tensor) -> bool:
        """Insert, evicting least recently used unpinned entries to make room; False when
        it cannot fit (then nothing is evicted)."""
        if mm_hash in self._entries:
            self._entries.move_to_end(mm_hash)
            return True
        size = _nbytes(emb)
        if size > self.capacity_bytes:
            return False
        excess = self.num_bytes + size - self.capacity_bytes
        victims = []
        for key, old in self._entries.items():
            if excess <= 0:
                break
            if key not in self._refs:
                victims.append(key)
                excess -= _nbytes(old)
        if excess > 0:
            return False  # the room is held by pinned entries
        for key in victims:
            self.num_bytes -= _nbytes(self._entries.pop(key))
        self._entries[mm_hash] = emb
        self.num_bytes += size
        return True

    def put_external(self, mm_hash: str, emb: torch.Tensor, *, hidden_size: int | None = None,
                     num_rows: int | None = None) -> bool:
        """Insert embeddings that arrived from another process (an encode worker), after
        checking their shape: [num_rows, hidden_size] when those are given."""
        if not isinstance(emb, torch.Tensor) or emb.dim() != 2 or not emb.is_floating_point():
            raise ValueError("external embeddings must be a 2-D floating point tensor")
        if (hidden_size is not None and emb.shape[1] != hidden_size) or \
                (num_rows is not None and emb.shape[0] != num_rows):
            raise ValueError(f"external embeddings of shape {tuple(emb.shape)} do not match "
                             f"[{num_rows}, {hidden_size}]")
        return self.put(mm_hash, emb.contiguous())

    def acquire(self, keys: Iterable[str]) -> None:
        """Pin ``keys`` (held or not yet inserted) while a step or a request uses them."""
        for key in keys:
            self._refs[key] = self._refs.get(key, 0) + 1

    def release(self, keys: Iterable[str]) -> None:
        for key in keys:
            n = self._refs.get(key, 0)
            if n <= 0:
                raise RuntimeError(f"encoder cache entry {key[:12]} released more than acquired")
            if n == 1:
                del self._refs[key]
            else:
                self._refs[key] = n - 1

    def num_pinned(self, mm_hash: str) -> int:
        return self._refs.get(mm_hash, 0)

    def keys(self) -> list[str]:
        """Held keys, least recently used first."""
        return list(self._entries)

    def check_integrity(self) -> None:
        assert self.num_bytes == sum(_nbytes(t) for t in self._entries.values())
        assert self.num_bytes <= self.capacity_bytes
        assert all(n > 0 for n in self._refs.values())
