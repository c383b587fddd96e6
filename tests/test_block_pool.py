"""BlockPool / KVCacheManager at tiny sizes: exact ids, ref counts, eviction order."""
from __future__ import annotations

import pytest

from triptych.engine.kv.block_hash import extend_block_hashes, hash_block
from triptych.engine.kv.block_pool import BlockPool
from triptych.engine.kv.kv_cache_manager import KVCacheManager
from triptych.engine.request import MMItem, Request
from triptych.engine.sample.sampling_params import SamplingParams


def make_req(rid: str, tokens: list[int], items: list[MMItem] | None = None) -> Request:
    return Request(rid, tokens, SamplingParams(max_tokens=4), items or [])


def test_allocate_free_lru_order():
    pool = BlockPool(4)
    a = pool.allocate(2)
    assert [b.block_id for b in a] == [0, 1]
    assert pool.num_free_blocks == 2 and all(b.ref_cnt == 1 for b in a)
    pool.free(list(reversed(a)))  # tail first
    # Free queue order is now 2, 3, 1, 0: fresh blocks first, then the freed tail before head.
    assert [b.block_id for b in pool.allocate(4)] == [2, 3, 1, 0]
    pool.check_integrity()


def test_double_free_asserts():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.free([b])
    with pytest.raises(AssertionError):
        pool.free([b])


def test_cached_block_survives_free_until_reused():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.cache_block(b, b"h1")
    pool.free([b])
    assert pool.lookup(b"h1") is b  # still findable while free
    pool.touch([b])
    assert b.ref_cnt == 1 and pool.num_free_blocks == 1
    pool.free([b])
    pool.allocate(2)  # reuses it: the hash is evicted
    assert pool.lookup(b"h1") is None and pool.num_evictions == 1
    pool.check_integrity()


def test_hash_chain_depends_on_parent_and_mm():
    h1 = hash_block(None, [1, 2], [])
    assert hash_block(h1, [3, 4], []) != hash_block(None, [3, 4], [])
    assert hash_block(None, [5, 5], ["imgA"]) != hash_block(None, [5, 5], ["imgB"])


def test_mm_hash_enters_every_overlapping_block():
    img = lambda h: MMItem("image", h, offset=2, length=5, grid_thw=(1, 2, 10))  # noqa: E731
    toks = [1, 2, 9, 9, 9, 9, 9, 3, 4]  # image spans tokens 2..6 -> blocks 0 and 1 (bs=4)
    ra, rb = make_req("a", toks, [img("A")]), make_req("b", toks, [img("B")])
    extend_block_hashes(ra, 4)
    extend_block_hashes(rb, 4)
    assert len(ra.block_hashes) == 2
    assert ra.block_hashes[0] != rb.block_hashes[0]
    assert ra.block_hashes[1] != rb.block_hashes[1]


def test_prefix_hit_and_last_token_recomputed():
    kv = KVCacheManager(num_blocks=8, block_size=4, enable_prefix_caching=True)
    r1 = make_req("r1", list(range(10)))
    hits, n = kv.get_computed_blocks(r1)
    assert (hits, n) == ([], 0)
    new = kv.allocate_slots(r1, 10, hits)
    assert [b.block_id for b in new] == [0, 1, 2]
    r1.num_computed_tokens = 10
    kv.cache_blocks(r1, 10)  # 2 full blocks cached
    kv.free(r1)
    r2 = make_req("r2", list(range(8)))  # exactly 2 blocks: the last block must be recomputed
    hits, n = kv.get_computed_blocks(r2)
    assert [b.block_id for b in hits] == [0] and n == 4
    r3 = make_req("r3", list(range(9)))
    hits, n = kv.get_computed_blocks(r3)
    assert [b.block_id for b in hits] == [0, 1] and n == 8
    new = kv.allocate_slots(r3, 1, hits)
    assert kv.block_ids("r3")[:2] == [0, 1] and len(new) == 1
    kv.check_integrity()


def test_allocate_slots_none_when_full_and_nothing_changes():
    kv = KVCacheManager(num_blocks=3, block_size=4, enable_prefix_caching=False)
    r1 = make_req("r1", list(range(8)))
    assert kv.allocate_slots(r1, 8) is not None
    r2 = make_req("r2", list(range(8)))
    before = kv.pool.num_free_blocks
    assert kv.allocate_slots(r2, 8) is None
    assert kv.pool.num_free_blocks == before and "r2" not in kv.req_blocks
    kv.check_integrity()


def test_handoff_holds_blocks_until_released():
    kv = KVCacheManager(num_blocks=4, block_size=4, enable_prefix_caching=False)
    r = make_req("r", list(range(6)))
    kv.allocate_slots(r, 6)
    ids = kv.take_blocks(r)
    assert ids == [0, 1] and kv.pool.num_free_blocks == 2
    kv.release_blocks("r")
    assert kv.pool.num_free_blocks == 4
    kv.check_integrity()
