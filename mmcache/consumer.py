"""The worker side of the processor cache: a message's items, with their pixels.

A worker that consumes pixels (the colocated / PD worker, a prefill worker that runs the
vision tower, an encode worker) gets each item's pixels one of four ways, as P0 decided:

    cache ""                  pixels in the next frame (no processor cache)
    cache "data"              pixels in the next frame; keep them under the key (lru store)
    cache "data-uncached"     pixels in the next frame; do not keep them
    cache "ref"               no frame: the worker's store holds them (a P0 hit)
    cache "shm"               no frame: read them from P0's shared-memory ring

Every cache op of a message is applied before anything else can refuse the request (the
store must stay what P0 planned). A ref the store does not hold, or a ring entry run over,
raises ``ProcessorCacheMiss``: the worker answers a retryable error naming the keys and P0
sends the pixels again. Frames and ring entries are checked (dtype, shape, length) before
they are viewed.
"""
from __future__ import annotations

from typing import Any

import torch
from triptych.worker import wire
from triptych.engine.request import MMItem
from triptych.mmcache.lru import (
    DATA,
    DATA_UNCACHED,
    REF,
    ProcessorCacheMiss,
    ProcessorCacheStore,
    StoreItem,
)

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


class WorkerPixels:
    """One worker's processor-cache state: an lru store, or a reader of P0's ring."""

    def __init__(self, kind: str, capacity_bytes: int, ring_name: str | None = None) -> None:
        self.kind = kind  # "lru" | "shm" | "" (no processor cache)
        self.store = ProcessorCacheStore(capacity_bytes) if kind == "lru" else None
        self.ring_name = ring_name
        self._reader = None
        self.num_misses = 0

    @classmethod
    def from_config(cls, config: dict, ring_name: str | None) -> WorkerPixels:
        from triptych.mmcache import processor_cache_bytes

        size = processor_cache_bytes(float(config.get("mm_processor_cache_gb", 0)))
        kind = str(config.get("mm_processor_cache_type", "lru")) if size else ""
        if kind == "shm" and not ring_name:
            kind = ""  # a worker on another host cannot map P0's ring: P0 sends pixels
        return cls(kind, size, ring_name)

    def items(self, items: list[wire.WireMMItem], frames: list[bytes],
              evicted: list[str]) -> list[MMItem]:
        """MMItems of a message (pixels resolved). Raises ValueError for a malformed
        message, ProcessorCacheMiss when a cached item is not where P0 said."""
        k = 1
        pixels: list[torch.Tensor | None] = []
        ops: list[StoreItem] = []
        for it in items:
            if len(it.grid_thw) != 3:
                raise ValueError("bad patch grid")
            if it.cache in ("", DATA, DATA_UNCACHED) and it.pixels is not None:
                if it.shm is not None:  # in a preparation process's segment, not a frame
                    t = self._read_segment(it)
                else:
                    n = wire.frames_of(it.pixels)  # a big image's pixels span several frames
                    if k + n > len(frames):
                        raise ValueError("tensor frames do not match the items")
                    t = wire.tensor_from_frames(it.pixels, frames[k:k + n])
                    k += n
                pixels.append(t)
                if it.cache:
                    ops.append(StoreItem(it.mm_hash, it.cache, t))
            elif it.cache == REF:
                if it.pixels is None or it.pixels.dtype not in _DTYPES:
                    raise ValueError("a cached item needs its dtype and shape")
                pixels.append(None)
                ops.append(StoreItem(it.mm_hash, REF, None,
                                     (_DTYPES[it.pixels.dtype], tuple(it.pixels.shape))))
            elif it.cache == "shm":
                pixels.append(self._read_ring(it))
            elif it.cache == "" and it.pixels is None:
                pixels.append(None)  # no pixels: its embedding is cached or on its way
            else:
                raise ValueError(f"unknown processor cache op {it.cache!r}")
        if k != len(frames):
            raise ValueError("tensor frames do not match the items")
        if ops or evicted:
            if self.store is None:
                raise ValueError("processor-cache ops for a worker without the lru cache")
            resolved = iter(self.store.apply(evicted, ops))  # ProcessorCacheMiss
            # apply returns one tensor per op, in order (refs resolved, data as sent)
            pixels = [next(resolved) if it.cache in (DATA, DATA_UNCACHED, REF) else p
                      for p, it in zip(pixels, items)]
        return [MMItem(it.modality, it.mm_hash, it.offset, it.length, tuple(it.grid_thw), pv,
                       it.second_per_grid_t) for it, pv in zip(items, pixels)]

    def items_of(self, msg: Any, frames: list[bytes]) -> list[MMItem] | wire.RequestError:
        """The items of an AddRequest / EncodeRequest, or the error that refuses it (a cache
        miss is retryable: P0 sends the pixels again)."""
        try:
            return self.items(msg.mm_items, frames, msg.cache_evicted)
        except ProcessorCacheMiss as e:
            return cache_miss_error(msg.request_id, e, msg.cache_seq)
        except (ValueError, TypeError) as e:
            return wire.RequestError(msg.request_id, str(e))

    def _read_segment(self, it: wire.WireMMItem) -> torch.Tensor:
        from triptych.mmcache.shm_ring import read_item

        assert it.shm is not None and it.pixels is not None
        if not it.shm.segment or (it.shm.dtype, list(it.shm.shape)) != \
                (it.pixels.dtype, list(it.pixels.shape)):
            raise ValueError("a prepared item's segment ref does not match its pixels")
        try:
            return read_item(it.shm, it.mm_hash)
        except ProcessorCacheMiss:
            self.num_misses += 1
            raise

    def _read_ring(self, it: wire.WireMMItem) -> torch.Tensor:
        if self.ring_name is None or it.shm is None:
            raise ValueError("a shared-memory item for a worker without the ring")
        if self._reader is None:
            from triptych.mmcache.shm_ring import ShmRingReader
            self._reader = ShmRingReader(self.ring_name)
        try:
            return self._reader.read(it.shm, it.mm_hash)
        except ProcessorCacheMiss:
            self.num_misses += 1
            raise

    def stats(self) -> dict[str, float]:
        if self.store is None:
            return {}
        return {"mm_processor_cache_usage_bytes": self.store.num_bytes,
                "mm_processor_cache_capacity_bytes": self.store.capacity_bytes}

    def close(self) -> None:
        if self._reader is not None:
            self._reader.close()


_PLAIN = WorkerPixels("", 0)


def items_from_wire(items: list[wire.WireMMItem], frames: list[bytes]) -> list[MMItem]:
    """MMItems of a message without processor-cache ops (pixels, if any, in the frames)."""
    return _PLAIN.items(items, frames, [])


def cache_miss_error(request_id: str, miss: ProcessorCacheMiss, seq: int) -> wire.RequestError:
    return wire.RequestError(request_id, str(miss), retryable=True, cache_missing=miss.keys,
                             cache_seq=seq)
