"""EncoderCache: bytes bound, 0 disables, pins, LRU order; EncoderRunner on top of it."""
from __future__ import annotations

import pytest
import torch

from triptych.engine.encoder.encoder_cache import EncoderCache
from triptych.engine.encoder.encoder_runner import EncoderRunner
from triptych.engine.request import MMItem

torch.set_num_threads(1)


def emb(rows: int, fill: float = 0.0, hidden: int = 4) -> torch.Tensor:
    return torch.full((rows, hidden), fill)  # rows * 16 bytes (fp32, hidden 4)


def test_size_strings_and_zero_disables():
    assert EncoderCache("1KiB").capacity_bytes == 1024
    assert EncoderCache(4096).capacity_bytes == 4096
    off = EncoderCache(0)
    assert off.put("a", emb(1)) is False and "a" not in off and off.num_bytes == 0
    off.acquire(["a"])
    assert off.put("a", emb(1)) is False  # pinned or not, nothing fits in 0 bytes
    off.release(["a"])
    with pytest.raises(ValueError):
        EncoderCache("lots")


def test_byte_bound_and_lru_order():
    c = EncoderCache(10 * 16)  # ten rows
    for k in "abcd":
        assert c.put(k, emb(3))
    assert c.keys() == ["b", "c", "d"] and c.num_bytes == 9 * 16  # "a" went first
    assert c.get("b") is not None  # b becomes the most recently used
    assert c.put("e", emb(2))
    assert c.keys() == ["d", "b", "e"]  # c was the least recently used
    assert c.put("big", emb(11)) is False and c.keys() == ["d", "b", "e"]  # never stored
    assert c.put("ten", emb(10)) and c.keys() == ["ten"]
    c.check_integrity()


def test_pinned_entries_are_never_evicted():
    c = EncoderCache(6 * 16)
    c.put("a", emb(3))
    c.put("b", emb(3))
    c.acquire(["a", "b"])
    assert c.put("c", emb(1)) is False and c.keys() == ["a", "b"]  # the room is pinned
    c.release(["b"])
    assert c.put("c", emb(1)) and c.keys() == ["a", "c"]  # b (unpinned) made room
    c.acquire(["a"])  # a is now pinned twice: one release keeps it
    c.release(["a"])
    assert c.put("d", emb(5)) is False and "a" in c
    c.release(["a"])
    assert c.num_pinned("a") == 0 and c.put("d", emb(5)) and c.keys() == ["c", "d"]
    with pytest.raises(RuntimeError, match="released more"):
        c.release(["a"])
    c.check_integrity()


def test_put_external_checks_shape():
    c = EncoderCache("1MiB")
    assert c.put_external("x", emb(3, hidden=8), hidden_size=8, num_rows=3)
    assert torch.equal(c.get("x"), emb(3, hidden=8))
    with pytest.raises(ValueError, match="do not match"):
        c.put_external("y", emb(3, hidden=8), hidden_size=16)
    with pytest.raises(ValueError, match="2-D"):
        c.put_external("y", torch.zeros(3, dtype=torch.int64).view(3, 1))
    assert "y" not in c


def item(key: str, rows: int) -> MMItem:
    # 4 patches per embedding row (merge 2x2); pixel value = a per-item constant
    fill = float(sum(map(ord, key)))
    return MMItem("image", key, 0, rows, (1, 2, 2 * rows), torch.full((4 * rows, 3), fill))


def fake_tower(pixels: torch.Tensor, grid: torch.Tensor) -> list[torch.Tensor]:
    out, start = [], 0
    for t, h, w in grid.tolist():
        n = t * h * w
        out.append(pixels[start:start + n].view(n // 4, 12)[:, :4].clone())
        start += n
    return out


@pytest.mark.parametrize("size", [0, "1MiB"])
def test_runner_hits_skip_the_tower(size):
    calls = []

    def tower(p: torch.Tensor, g: torch.Tensor) -> list[torch.Tensor]:
        calls.append(len(g))
        return fake_tower(p, g)

    cache = EncoderCache(size)
    runner = EncoderRunner(tower, cache, torch.device("cpu"), torch.float32)
    a, b = item("a", 2), item("b", 3)
    first = runner.get_embeddings([a, b, a])
    second = runner.get_embeddings([b, a])
    assert torch.equal(first["a"], second["a"]) and torch.equal(first["b"], second["b"])
    assert first["a"].shape == (2, 4)
    if size == 0:  # really disabled: the tower runs again
        assert calls == [2, 2] and len(cache) == 0 and cache.num_hits == 0
    else:
        assert calls == [2] and (cache.num_queries, cache.num_hits) == (4, 2)
    a.pixel_values = None
    if size == 0:
        with pytest.raises(ValueError, match="neither cached nor attached"):
            runner.get_embeddings([a])
    else:
        assert torch.equal(runner.get_embeddings([a])["a"], first["a"])


def test_runner_keeps_its_own_hits_while_inserting():
    cache = EncoderCache(5 * 16)  # five rows: "a" (3) is a hit, "b" (2) + "c" (2) miss
    runner = EncoderRunner(fake_tower, cache, torch.device("cpu"), torch.float32)
    runner.get_embeddings([item("a", 3)])
    out = runner.get_embeddings([item("a", 3), item("b", 2), item("c", 2)])
    assert set(out) == {"a", "b", "c"} and "a" in cache  # "a" was pinned during the call
    assert cache.num_bytes <= 5 * 16 and cache.num_pinned("a") == 0
    cache.check_integrity()
