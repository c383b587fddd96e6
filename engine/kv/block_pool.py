"""BlockPool: KV cache block bookkeeping (ids, ref counts, prefix-cache hashes).

Only bookkeeping lives here; the cache tensors are owned by the model runner.

    free queue (LRU order, evict from the left)        cached map
    [b7 b3 b9 ...]  <- ref_cnt == 0, may still hold a hash   hash -> block
A freed block keeps its hash (and stays findable) until it is handed out again.
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0
    block_hash: bytes | None = None  # set once the block is full and cached


class BlockPool:
    def __init__(self, num_blocks: int, enable_caching: bool = True) -> None:
        assert num_blocks > 0
        self.num_blocks = num_blocks
        self.enable_caching = enable_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # block_id -> block, in eviction order (left = least recently freed)
        self._free: OrderedDict[int, KVBlock] = OrderedDict((b.block_id, b) for b in self.blocks)
        self._cached: dict[bytes, KVBlock] = {}
        self.num_evictions = 0  # cached blocks reused for new content

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_cached_blocks(self) -> int:
        """Blocks findable by their hash (in use or free): the prefix cache's content."""
        return len(self._cached)

    @property
    def usage(self) -> float:
        return 1.0 - self.num_free_blocks / self.num_blocks

    def can_allocate(self, n: int) -> bool:
        return n <= len(self._free)

    def allocate(self, n: int) -> list[KVBlock]:
        """Take ``n`` blocks from the LRU end of the free queue (caller checked can_allocate)."""
        if n > len(self._free):
            raise RuntimeError(f"asked for {n} KV blocks, {len(self._free)} free")
        out = []
        for _ in range(n):
            _, blk = self._free.popitem(last=False)
            if blk.block_hash is not None:
                if self._cached.get(blk.block_hash) is blk:
                    del self._cached[blk.block_hash]
                blk.block_hash = None
                self.num_evictions += 1
            blk.ref_cnt = 1
            out.append(blk)
        return out

    def lookup(self, block_hash: bytes) -> KVBlock | None:
        return self._cached.get(block_hash) if self.enable_caching else None

    def touch(self, blocks: list[KVBlock]) -> None:
        """Take a reference on prefix-cache hits; a hit on a free block revives it."""
        for blk in blocks:
            if blk.ref_cnt == 0:
                del self._free[blk.block_id]
            blk.ref_cnt += 1

    def free(self, blocks: list[KVBlock]) -> None:
        """Drop one reference per block. Pass blocks tail-first so that a request's last
        blocks (least likely to be shared) are evicted before its first ones."""
        for blk in blocks:
            assert blk.ref_cnt > 0, f"double free of block {blk.block_id}"
            blk.ref_cnt -= 1
            if blk.ref_cnt == 0:
                self._free[blk.block_id] = blk

    def cache_block(self, blk: KVBlock, block_hash: bytes) -> None:
        """Register a full block under its hash (first writer wins on duplicates)."""
        if not self.enable_caching or blk.block_hash is not None:
            return
        if block_hash not in self._cached:
            blk.block_hash = block_hash
            self._cached[block_hash] = blk

    def reset_prefix_cache(self) -> None:
        for blk in self._cached.values():
            blk.block_hash = None
        self._cached.clear()

    def check_integrity(self) -> None:
        """free + used == total; cached map and block hashes agree."""
        used = [b for b in self.blocks if b.ref_cnt > 0]
        assert len(used) + len(self._free) == self.num_blocks
        assert all(b.ref_cnt == 0 for b in self._free.values())
        for h, b in self._cached.items():
            assert b.block_hash == h
