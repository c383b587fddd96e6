"""KVCacheManager: which KV blocks each request holds, and prefix-cache hits.

Check, then commit: ``allocate_slots`` returns None (nothing changed) when blocks run
out, which tells the scheduler to preempt.
"""
from __future__ import annotations

from triptych.engine.kv.block_hash import extend_block_hashes
from triptych.engine.kv.block_pool import BlockPool, KVBlock
from triptych.engine.request import Request


class KVCacheManager:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool) -> None:
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        self.req_blocks: dict[str, list[KVBlock]] = {}
        self.num_published: dict[str, int] = {}  # request id -> its leading blocks already
        # offered to the prefix cache (each step offers only the blocks filled since)
        # Blocks of requests that left after prefill, held until their transfer completes.
        self.handed_off: dict[str, list[KVBlock]] = {}
        self.num_prefix_queries = 0  # prompt tokens looked up in the prefix cache
        self.num_prefix_hits = 0  # of which found

    @property
    def usage(self) -> float:
        return self.pool.usage

    def block_ids(self, request_id: str) -> list[int]:
        return [b.block_id for b in self.req_blocks.get(request_id, ())]

    def get_computed_blocks(self, request: Request) -> tuple[list[KVBlock], int]:
        """Longest cached prefix of the request, in blocks and tokens (no refs taken).

        At least one token is always left to compute: its logits pick the next token.
        """
        if not self.enable_prefix_caching:
            return [], 0
        extend_block_hashes(request, self.block_size)
        # The last token must be computed, so only blocks before it can be hits.
        max_hit_blocks = (request.num_tokens - 1) // self.block_size
        hits: list[KVBlock] = []
        for h in request.block_hashes[:max_hit_blocks]:
            blk = self.pool.lookup(h)
            if blk is None:
                break
            hits.append(blk)
        return hits, len(hits) * self.block_size

    def record_prefix_lookup(self, num_tokens: int, num_hit_tokens: int) -> None:
        """Count one admission's lookup (a request that waits is looked up again; only the
        lookup that admits it counts)."""
        self.num_prefix_queries += num_tokens
        self.num_prefix_hits += num_hit_tokens

    def allocate_slots(self, request: Request, num_new_tokens: int,
                       new_computed_blocks: list[KVBlock] | None = None) -> list[KVBlock] | None:
        """Make room for ``num_new_tokens`` more tokens after the computed ones.

        ``new_computed_blocks`` are prefix-cache hits found for a request being admitted.
        Returns the newly allocated blocks, or None if the pool cannot hold them.
        """
        held = self.req_blocks.get(request.request_id, [])
        if not new_computed_blocks and len(held) * self.block_size >= \
                request.num_computed_tokens + num_new_tokens:
            return []  # room in its blocks already (a decode, 15 steps in 16): no list copied
        hits = new_computed_blocks or []
        num_computed = request.num_computed_tokens + len(hits) * self.block_size
        need_blocks = -(-(num_computed + num_new_tokens) // self.block_size)
        num_alloc = need_blocks - len(held) - len(hits)
        # Hits on free blocks leave the free queue when touched: count them against it.
        num_revived = sum(1 for b in hits if b.ref_cnt == 0)
        if num_alloc + num_revived > self.pool.num_free_blocks:
            return None
        self.pool.touch(hits)
        new = self.pool.allocate(max(num_alloc, 0))
        self.req_blocks[request.request_id] = held + hits + new
        return new

    def cache_blocks(self, request: Request, num_computed_tokens: int) -> None:
        """Publish the request's full blocks whose KV is written (up to num_computed_tokens)."""
        if not self.enable_prefix_caching:
            return
        rid = request.request_id
        if num_computed_tokens // self.block_size <= self.num_published.get(rid, 0):
            return  # no block filled since the last call (hashes are extended when needed)
        extend_block_hashes(request, self.block_size)
        blocks = self.req_blocks.get(rid, [])
        n = min(num_computed_tokens // self.block_size, len(request.block_hashes), len(blocks))
        for i in range(self.num_published.get(rid, 0), n):
            self.pool.cache_block(blocks[i], request.block_hashes[i])
        if n:
            self.num_published[rid] = max(n, self.num_published.get(rid, 0))

    def free(self, request: Request) -> None:
        self.num_published.pop(request.request_id, None)
        blocks = self.req_blocks.pop(request.request_id, [])
        self.pool.free(list(reversed(blocks)))

    def take_blocks(self, request: Request) -> list[int]:
        """Hand a request's blocks over (disaggregation): the caller frees them later with
        ``release_blocks`` once the transfer is done."""
        self.num_published.pop(request.request_id, None)
        blocks = self.req_blocks.pop(request.request_id, [])
        self.handed_off[request.request_id] = blocks
        return [b.block_id for b in blocks]

    def release_blocks(self, request_id: str) -> None:
        blocks = self.handed_off.pop(request_id, [])
        self.pool.free(list(reversed(blocks)))

    def check_integrity(self) -> None:
        self.pool.check_integrity()
        for rid, blocks in self.req_blocks.items():
            assert all(b.ref_cnt > 0 for b in blocks), rid
