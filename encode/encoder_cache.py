"""EncoderCache: vision embeddings by mm hash, so a repeated image skips the tower.

LRU bounded by embedding rows. Entries the current step needs are pinned while it runs.
"""
from __future__ import annotations

from collections import OrderedDict

import torch


class EncoderCache:
    def __init__(self, max_rows: int) -> None:
        self.max_rows = max_rows
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.num_rows = 0
        self.num_queries = 0  # items looked up
        self.num_hits = 0  # of which found

    def __contains__(self, mm_hash: str) -> bool:
        return mm_hash in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, mm_hash: str) -> torch.Tensor | None:
        emb = self._entries.get(mm_hash)
        if emb is not None:
            self._entries.move_to_end(mm_hash)
        return emb

    def put(self, mm_hash: str, emb: torch.Tensor, pinned: set[str] = frozenset()) -> None:
        """Insert, evicting least recently used entries not in ``pinned`` to make room."""
        if mm_hash in self._entries:
            return
        self._entries[mm_hash] = emb
        self.num_rows += emb.shape[0]
        for key in list(self._entries):
            if self.num_rows <= self.max_rows:
                break
            if key == mm_hash or key in pinned:
                continue
            self.num_rows -= self._entries.pop(key).shape[0]
