"""LocalPixels: the processor cache of an engine in this process (the offline ``LLM``).

P0's mirror and P1's store side by side: a repeated image skips decode and the HF
processor (the index in InputProcessor) and takes its pixels from the store; pixels the
store no longer holds are produced again. Same plan/apply code as across processes.
"""
from __future__ import annotations

from typing import Any

from triptych.mmcache.lru import REF, ProcessorCacheMirror, ProcessorCacheStore, StoreItem


class LocalPixels:
    def __init__(self, capacity_bytes: int, processor: Any) -> None:
        self.mirror = ProcessorCacheMirror(capacity_bytes)
        self.store = ProcessorCacheStore(capacity_bytes)
        self.processor = processor

    def fill(self, prompt: Any) -> None:
        """Give every item of a ProcessedPrompt its pixels (stored, or produced again)."""
        items = prompt.mm_items
        if not items:
            return
        sources = prompt.mm_sources or [None] * len(items)
        while True:
            sizes = [(it.mm_hash, it.pixel_values.numel() * it.pixel_values.element_size()
                      if it.pixel_values is not None else src.meta.nbytes)
                     for it, src in zip(items, sources)]
            plan = self.mirror.plan(sizes, [it.pixel_values is not None for it in items])
            if not plan.need_data:
                break
            for i in plan.need_data:
                self.processor.load_pixels(items[i], sources[i])
        ops = [StoreItem(it.mm_hash, op, None if op == REF else it.pixel_values)
               for it, op in zip(items, plan.ops)]
        for it, pv in zip(items, self.store.apply(plan.evicted, ops)):
            it.pixel_values = pv
