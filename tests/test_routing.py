"""The router's worker choice: least work once the request is added, prefix-aware."""
from __future__ import annotations

from triptych.router.layout import Layout
from triptych.router.routing import PrefixIndex, pick
from triptych.config import EngineConfig


def test_prefix_index_matches_leading_blocks_and_forgets_oldest():
    idx = PrefixIndex(capacity_blocks=4)
    idx.record([b"a", b"b", b"c"])
    assert idx.match([b"a", b"b", b"x", b"c"]) == 2
    assert idx.match([b"b"]) == 1 and idx.match([b"x", b"a"]) == 0
    idx.record([b"d", b"e"])  # 5 hashes in 4 places: the oldest ("a") goes
    assert idx.match([b"a"]) == 0 and idx.match([b"b", b"c", b"d", b"e"]) == 4
    idx.discard([b"c"])
    assert idx.match([b"b", b"c"]) == 1


def test_pick_least_work_after_the_request():
    ws = ["w0", "w1", "w2"]
    assert pick(ws, [0, 0, 0], [0, 0, 0]) == "w0"  # ties: first
    assert pick(ws, [50, 10, 30], [0, 0, 0]) == "w1"  # least loaded
    # A long cached conversation (2000 tokens) outweighs a busier queue ...
    assert pick(ws, [300, 10, 30], [2000, 0, 0]) == "w0"
    # ... a short shared template prefix (16 tokens) does not.
    assert pick(ws, [300, 10, 30], [16, 0, 0]) == "w1"
    # Equal work after the request: the less loaded worker.
    assert pick(ws, [100, 60, 90], [40, 0, 0]) == "w1"


def test_layouts_from_knobs():
    def lay(**kw):
        return Layout.from_config(EngineConfig(model="m", **kw))
    assert str(lay()) == "colocated x1"
    assert str(lay(data_parallel_size=3)) == "colocated x3"
    assert lay(decode_workers=2).pools == {"decode": 2}
    e_pd = lay(encode_workers=1, decode_workers=2)
    assert e_pd.has_encode_pool and not e_pd.has_prefill_pool and e_pd.main_pool == "decode"
    epd = lay(encode_workers=1, prefill_workers=2, decode_workers=3)
    assert str(epd) == "1e2p3d" and epd.num_workers == 6
    assert epd.pools_for(has_media=False) == ["prefill", "decode"]  # text skips encode
    assert epd.pools_for(has_media=True) == ["encode", "prefill", "decode"]


def test_kv_cache_memory_is_sized_per_pool():
    def kv(**kw):
        return Layout.from_config(EngineConfig(model="m", **kw)).kv_cache_memory
    gib, mib = 1 << 30, 1 << 20
    assert kv() == {"colocated": gib}
    assert kv(decode_workers=2) == {"decode": gib}
    # P+D: the prefill side holds prompts only until they are handed on; encode has no KV.
    assert kv(encode_workers=1, prefill_workers=1, decode_workers=1) == {
        "prefill": 512 * mib, "decode": gib}
    # A value the user gives applies to every worker.
    assert kv(prefill_workers=1, decode_workers=1, kv_cache_memory="2GiB") == {
        "prefill": 2 * gib, "decode": 2 * gib}
    lay = Layout.from_config(EngineConfig(model="m", encode_workers=1, prefill_workers=1,
                                          decode_workers=1, kv_cache_memory="64MiB"))
    assert lay.worker_knobs("prefill") == {"tensor_parallel_size": 1,
                                           "kv_cache_memory": 64 * mib}
    assert lay.worker_knobs("encode") == {"tensor_parallel_size": 1}
