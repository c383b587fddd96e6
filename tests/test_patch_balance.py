"""The patch-balanced split of mm_encoder_tp_mode="data" (parallel/patch_balance.py)."""
from __future__ import annotations

import itertools
import random

import pytest
from triptych.parallel.patch_balance import balance_by_patches


def best_max_load(patches: list[int], n: int) -> int:
    """The optimal split's max load, by brute force (small cases only)."""
    best = sum(patches)
    for owners in itertools.product(range(n), repeat=len(patches)):
        loads = [0] * n
        for p, r in zip(patches, owners):
            loads[r] += p
        best = min(best, max(loads))
    return best


def test_one_large_image_outweighs_many_small_ones():
    # one 1344x1344 image (96x96 patches) and ten 224x224 ones (16x16): by count, rank 0
    # would get the large one and four small ones; by patches it gets the large one alone
    a = balance_by_patches([256] * 5 + [9216] + [256] * 5, 2)
    assert a.ranks == [[5], [0, 1, 2, 3, 4, 6, 7, 8, 9, 10]]
    assert a.loads == [9216, 2560]


def test_assignment_order_and_inverse():
    patches = [64, 64, 900, 64, 64, 64]  # the large one in the middle
    a = balance_by_patches(patches, 2)
    assert a.ranks == [[2], [0, 1, 3, 4, 5]]
    assert a.order == [2, 0, 1, 3, 4, 5]
    assert a.inverse == [1, 2, 0, 3, 4, 5]
    # outputs that arrive rank by rank go back into batch order through the inverse
    arrived = [f"emb{i}" for i in a.order]
    assert [arrived[j] for j in a.inverse] == [f"emb{i}" for i in range(6)]


def test_every_item_once_and_loads_add_up():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(1, 5)
        patches = [rng.choice([16, 64, 256, 1024, 4096]) * rng.randint(1, 3)
                   for _ in range(rng.randint(0, 12))]
        a = balance_by_patches(patches, n)
        assert sorted(a.order) == list(range(len(patches)))
        assert all(items == sorted(items) for items in a.ranks)  # batch order kept per rank
        assert a.loads == [sum(patches[i] for i in items) for items in a.ranks]
        assert sorted(a.inverse) == list(range(len(patches)))
        assert all(a.order[a.inverse[i]] == i for i in range(len(patches)))
        if patches:  # the LPT bound
            assert max(a.loads) <= sum(patches) / n + max(patches)


def test_max_load_within_four_thirds_of_the_best_split():
    rng = random.Random(1)
    for _ in range(60):
        n = rng.randint(2, 3)
        patches = [rng.randint(1, 40) * 16 for _ in range(rng.randint(1, 7))]
        a = balance_by_patches(patches, n)
        assert max(a.loads) * 3 <= 4 * best_max_load(patches, n), (patches, a)


def test_more_ranks_than_items_and_edge_cases():
    a = balance_by_patches([100, 50], 4)
    assert a.ranks == [[0], [1], [], []] and a.loads == [100, 50, 0, 0]
    assert balance_by_patches([], 2).ranks == [[], []]
    # equal items spread round-robin, deterministically
    assert balance_by_patches([16] * 4, 2).ranks == [[0, 2], [1, 3]]
    with pytest.raises(ValueError):
        balance_by_patches([1], 0)
    with pytest.raises(ValueError):
        balance_by_patches([-1], 2)
