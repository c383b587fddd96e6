"""mmcache: multimodal content keys and the processor cache between P0 and P1.

- ``hashing``: keys from encoded bytes, pixels or a client uuid (+ processor kwargs)
- ``ProcessorCacheIndex`` (P0): key -> item metadata, so a hit skips the HF processor
- ``lru``: ``ProcessorCacheMirror`` (P0, one per worker) + ``ProcessorCacheStore`` (P1)
- ``shm_ring``: ``ShmRingWriter`` (P0) + ``ShmRingReader`` (every worker on the host)
"""
from triptych.mmcache.index import ItemMeta, ProcessorCacheIndex
from triptych.mmcache.lru import (
    DATA,
    DATA_UNCACHED,
    REF,
    CachePlan,
    ProcessorCacheMirror,
    ProcessorCacheMiss,
    ProcessorCacheStore,
    StoreItem,
)

__all__ = ["DATA", "DATA_UNCACHED", "REF", "CachePlan", "ItemMeta", "ProcessorCacheIndex",
           "ProcessorCacheMirror", "ProcessorCacheMiss", "ProcessorCacheStore", "StoreItem",
           "processor_cache_bytes"]


def processor_cache_bytes(mm_processor_cache_gb: float) -> int:
    """Bytes each side of the processor cache may hold (GiB, as vLLM counts them)."""
    if mm_processor_cache_gb < 0:
        raise ValueError("mm_processor_cache_gb must be >= 0")
    return int(mm_processor_cache_gb * (1 << 30))
