"""PixelPlanner (P0): how each item's pixels reach the worker that consumes them.

The pixel consumer of a request is the worker that runs the vision tower on it (the
colocated / PD worker, a prefill worker without an encode pool, else an encode worker).
Per ``mm_processor_cache_type``:

    ""    no processor cache: pixels travel in every message
    lru   one ProcessorCacheMirror per consumer (mmcache/lru.py): an item the worker holds
          travels as a ref (its key); otherwise as data the worker stores, evicting what
          P0's plan says
    shm   P0's ShmRingWriter (mmcache/shm_ring.py): pixels written once to shared memory,
          every worker on this host reads them there; too big or in a pinned entry's way:
          inline

NOTE (the lru mirror's rule): a plan and its message go out together, under the
consumer's lock, so the worker applies plans in the order they were made. An item P0 has
no pixels for (a processor-cache hit in P0) that the worker does not hold is produced
again (``InputProcessor.load_pixels``, in a thread, outside the lock) and planned again.
"""
from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import Any

import msgspec
import torch
from triptych.worker import wire
from triptych.engine.request import MMItem
from triptych.mmcache.lru import DATA, DATA_UNCACHED, ProcessorCacheMirror
from triptych.mmcache.shm_ring import read_item

SendFrames = Callable[[Any, list[bytes]], Awaitable[bool]]
Build = Callable[[list[wire.WireMMItem], list[str], int], msgspec.Struct]


def _has_pixels(it: MMItem, src: Any) -> bool:
    """P0 can send ``it``'s pixels: it holds them, or a preparation process left them in
    shared memory (the consumer reads them there)."""
    return it.pixel_values is not None or getattr(src, "prepared", None) is not None


def _load_prepared(it: MMItem, src: Any) -> None:
    """Give a prepared item its pixels in P0 (for a worker that cannot read the segment)."""
    if it.pixel_values is None and getattr(src, "prepared", None) is not None:
        it.pixel_values = read_item(src.prepared.ref(src.group), it.mm_hash)


def _nbytes(it: MMItem, src: Any) -> int:
    if it.pixel_values is not None:
        return it.pixel_values.numel() * it.pixel_values.element_size()
    if src is None or src.meta is None:  # a bug upstream: no pixels and no way to make them
        raise RuntimeError(f"{it.modality} {it.mm_hash[:12]} has neither pixels nor a source")
    return src.meta.nbytes


def _meta(it: MMItem, src: Any) -> wire.TensorMeta:
    if it.pixel_values is not None:
        return wire.tensor_meta(it.pixel_values)
    return wire.TensorMeta(src.meta.dtype, list(src.meta.shape))


def _item(it: MMItem, src: Any, cache: str = "", shm: Any = None) -> wire.WireMMItem:
    if shm is None and it.pixel_values is None and getattr(src, "prepared", None) is not None:
        shm = src.prepared.ref(src.group)  # the data is in its segment, not in a frame
    return wire.WireMMItem(it.modality, it.mm_hash, it.offset, it.length, list(it.grid_thw),
                           _meta(it, src), it.second_per_grid_t, cache, shm)


def _frames(items: list[MMItem], sources: list[Any], ops: list[str] | None = None
            ) -> list[torch.Tensor]:
    """The tensors that travel as frames: those P0 holds (prepared ones are read from
    their segment by the consumer)."""
    return [it.pixel_values for i, it in enumerate(items)
            if it.pixel_values is not None and (ops is None or ops[i] in (DATA, DATA_UNCACHED))]


class PixelPlanner:
    def __init__(self, kind: str, capacity_bytes: int, processor: Any | None) -> None:
        self.kind = kind if capacity_bytes > 0 and processor is not None else ""
        self.capacity_bytes = capacity_bytes
        self.processor = processor
        self._mirrors: dict[Any, ProcessorCacheMirror] = {}
        self._locks: dict[Any, asyncio.Lock] = {}
        self.ring = None
        if self.kind == "shm":
            from triptych.mmcache.shm_ring import ShmRingWriter
            self.ring = ShmRingWriter(capacity_bytes)
        self.num_loaded = 0  # items whose pixels P0 produced again for a worker lacking them

    @property
    def ring_name(self) -> str | None:
        return self.ring.name if self.ring is not None else None

    def _lock(self, w: Any) -> asyncio.Lock:
        return self._locks.setdefault(w, asyncio.Lock())

    async def send(self, w: Any, items: list[MMItem], sources: list[Any], build: Build,
                   send_frames: SendFrames, pins: list[str]) -> bool:
        """Plan ``items`` for consumer ``w``, build the message (``build(wire_items,
        evicted, seq)``) and send it; False when ``w`` cannot be reached. Keys pinned in
        the ring are appended to ``pins`` (unpin them when the request ends)."""
        if getattr(w, "remote", None):  # another host cannot map P0's segments: frames
            await asyncio.gather(*(asyncio.to_thread(_load_prepared, it, src)
                                   for it, src in zip(items, sources)))
        while True:
            async with self._lock(w):
                planned = self._plan(w, items, sources, pins)
                if planned is not None:
                    wire_items, tensors, evicted, seq = planned
                    frames = wire.encode(build(wire_items, evicted, seq)) + \
                        wire.encode_tensors(tensors)
                    return await send_frames(w, frames)
            missing = [(it, src) for it, src in zip(items, sources) if not _has_pixels(it, src)]
            await asyncio.gather(*(asyncio.to_thread(self.processor.load_pixels, it, src)
                                   for it, src in missing))
            self.num_loaded += len(missing)

    def _plan(self, w: Any, items: list[MMItem], sources: list[Any], pins: list[str]
              ) -> tuple[list[wire.WireMMItem], list[torch.Tensor], list[str], int] | None:
        """None: an item needs pixels P0 does not have (nothing was changed)."""
        if self.kind == "lru":
            mirror = self._mirrors.setdefault(w, ProcessorCacheMirror(self.capacity_bytes))
            plan = mirror.plan([(it.mm_hash, _nbytes(it, src)) for it, src in zip(items, sources)],
                               [_has_pixels(it, src) for it, src in zip(items, sources)])
            if plan.need_data:
                return None
            return ([_item(it, src, op) for it, src, op in zip(items, sources, plan.ops)],
                    _frames(items, sources, plan.ops), plan.evicted, plan.seq)
        if self.kind == "shm":
            return self._plan_ring(items, sources, pins)
        if not all(_has_pixels(it, src) for it, src in zip(items, sources)):
            return None
        return [_item(it, src) for it, src in zip(items, sources)], \
            _frames(items, sources), [], 0

    def _plan_ring(self, items: list[MMItem], sources: list[Any], pins: list[str]
                   ) -> tuple[list[wire.WireMMItem], list[torch.Tensor], list[str], int] | None:
        assert self.ring is not None
        out, tensors, pinned = [], [], []
        for it, src in zip(items, sources):
            ref = self.ring.get(it.mm_hash, pin=True)
            if ref is None and not _has_pixels(it, src):
                for k in pinned:
                    self.ring.unpin(k)
                return None
            if ref is None:
                # NOTE: prepared pixels are copied from their segment into the ring (the
                # ring is what later requests find); where it has no room, the consumer
                # reads them from the segment
                pixels = it.pixel_values if it.pixel_values is not None else \
                    read_item(src.prepared.ref(src.group), it.mm_hash)
                ref = self.ring.put(it.mm_hash, pixels, pin=True)
            if ref is None:  # larger than the ring, or a pinned entry in the way
                out.append(_item(it, src))
                if it.pixel_values is not None:
                    tensors.append(it.pixel_values)
            else:
                pinned.append(it.mm_hash)
                out.append(_item(it, src, "shm", ref))
        pins += pinned
        return out, tensors, [], 0

    def unpin(self, keys: list[str]) -> None:
        if self.ring is not None:
            for k in keys:
                self.ring.unpin(k)

    def forget(self, w: Any, keys: list[str], seq: int) -> None:
        """``w`` reported these keys missing while applying plan ``seq``."""
        mirror = self._mirrors.get(w)
        if mirror is not None:
            mirror.forget(keys, seq)

    @staticmethod
    def forget_prepared(prompt: Any, keys: list[str]) -> None:
        """A consumer could not read these items' segments: P0 makes their pixels again
        (``load_pixels``) rather than point at the segments once more."""
        for it, src in zip(prompt.mm_items, prompt.mm_sources):
            if it.mm_hash in keys and getattr(src, "prepared", None) is not None:
                src.prepared = None

    async def reset(self, w: Any) -> None:
        """``w`` restarted with an empty store (under its lock: no plan in flight)."""
        mirror = self._mirrors.get(w)
        if mirror is not None:
            async with self._lock(w):
                mirror.forget_all()

    def stats(self) -> dict[str, float]:
        s: dict[str, float] = {"mm_processor_cache_capacity_bytes": self.capacity_bytes
                               if self.kind else 0}
        if self.ring is not None:
            s["mm_processor_cache_usage_bytes"] = self.ring.num_bytes
        if self.processor is not None:
            s.update(self.processor.stats())
        return s

    def close(self) -> None:
        if self.ring is not None:
            self.ring.close()
