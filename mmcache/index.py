"""ProcessorCacheIndex (P0): mm key -> what the prompt needs of a processed item.

On a hit, api/processor.py builds the prompt from this metadata alone (placeholder count,
patch grid, second_per_grid_t) and skips decoding and the HF processor; the item leaves P0
with ``pixel_values=None`` and the router decides per worker whether a cache reference is
enough or the pixels must be produced again (see api/processor.py: ``load_pixels``).

The index holds no tensors. It is bounded by the nominal bytes of the items it describes
(the same budget as the processor cache behind it, so it forgets roughly what the workers
forget) and by a number of entries; LRU. Thread-safe: P0 processes prompts in a thread pool.
"""
from __future__ import annotations

import math
import threading
from collections import OrderedDict
from dataclasses import dataclass

import torch

_ITEMSIZE = {"float32": 4, "float16": 2, "bfloat16": 2}


@dataclass(frozen=True)
class ItemMeta:
    """Everything about a processed item except its pixels."""

    modality: str  # "image" | "video"
    grid_thw: tuple[int, int, int]  # patch grid before the spatial merge
    length: int  # placeholder tokens (= embedding rows)
    dtype: str  # pixel_values dtype, e.g. "float32"
    shape: tuple[int, ...]  # pixel_values shape [patches, patch_dim]
    second_per_grid_t: float | None = None  # video only
    num_frames: int | None = None  # video only: frames sampled, before any padding

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * _ITEMSIZE[self.dtype]

    @classmethod
    def of(cls, modality: str, grid_thw: tuple[int, int, int], length: int,
           pixel_values: torch.Tensor, second_per_grid_t: float | None = None,
           num_frames: int | None = None) -> ItemMeta:
        dtype = str(pixel_values.dtype).removeprefix("torch.")
        if dtype not in _ITEMSIZE:
            raise ValueError(f"unsupported pixel dtype {dtype}")
        return cls(modality, tuple(int(x) for x in grid_thw), int(length), dtype,
                   tuple(int(s) for s in pixel_values.shape), second_per_grid_t, num_frames)

    def matches(self, pixel_values: torch.Tensor) -> bool:
        return (str(pixel_values.dtype).removeprefix("torch.") == self.dtype
                and tuple(pixel_values.shape) == self.shape)


class ProcessorCacheIndex:
    def __init__(self, capacity_bytes: int, max_entries: int = 1 << 16) -> None:
        if capacity_bytes < 0 or max_entries < 0:
            raise ValueError("capacity_bytes and max_entries must be >= 0")
        self.capacity_bytes = capacity_bytes
        self.max_entries = max_entries
        self._entries: OrderedDict[str, ItemMeta] = OrderedDict()
        self._lock = threading.Lock()
        self.num_bytes = 0  # nominal pixel bytes of the items described
        self.num_queries = 0  # lookups
        self.num_hits = 0  # of which found

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def lookup(self, key: str) -> ItemMeta | None:
        """Counted lookup; a hit becomes the most recently used entry."""
        with self._lock:
            self.num_queries += 1
            meta = self._entries.get(key)
            if meta is not None:
                self.num_hits += 1
                self._entries.move_to_end(key)
            return meta

    def peek(self, key: str) -> ItemMeta | None:
        """A lookup that changes nothing: no counters, no recency (P0-only readers such as
        /tokenize must not move P0's eviction order away from the workers' mirror)."""
        with self._lock:
            return self._entries.get(key)

    def put(self, key: str, meta: ItemMeta) -> bool:
        """Remember ``meta``; False when it is larger than the whole budget (not stored)."""
        size = meta.nbytes
        with self._lock:
            if key in self._entries:
                self._entries.move_to_end(key)
                return True
            if size > self.capacity_bytes or self.max_entries == 0:
                return False
            while self._entries and (self.num_bytes + size > self.capacity_bytes
                                     or len(self._entries) >= self.max_entries):
                _, old = self._entries.popitem(last=False)
                self.num_bytes -= old.nbytes
            self._entries[key] = meta
            self.num_bytes += size
            return True

    def discard(self, key: str) -> None:
        """Forget ``key`` (e.g. its content turned out not to match the metadata)."""
        with self._lock:
            meta = self._entries.pop(key, None)
            if meta is not None:
                self.num_bytes -= meta.nbytes

    def stats(self) -> dict[str, float]:
        return {"mm_processor_cache_queries": float(self.num_queries),
                "mm_processor_cache_hits": float(self.num_hits),
                "mm_processor_cache_index_entries": float(len(self._entries)),
                "mm_processor_cache_index_bytes": float(self.num_bytes)}
