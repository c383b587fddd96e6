"""Split a batch of images across ranks by patch count (mm_encoder_tp_mode="data").

The vision tower's cost grows with patches (linear layers) and patches squared per frame
(attention), so one 1344x1344 image (9,216 patches) outweighs ten 224x224 ones (256 each):
splitting by image count would leave one rank with almost all the work. This is the
longest-processing-time-first rule: items in decreasing patch count, each to the rank
with the least load so far (ties: the lower rank).

    patches   [900, 64, 64, 64, 64, 64]   2 ranks
    ranks     [[0], [1, 2, 3, 4, 5]]       loads [900, 320]
    order     [0, 1, 2, 3, 4, 5]           rank 0's items, then rank 1's
    inverse   position of item i in ``order``: outputs gathered rank by rank go back
              into the batch's order with ``[gathered[j] for j in inverse]``

Bound: max load <= total / N + the largest item (LPT never gives the most loaded rank an
item it did not need beyond the average), and within 4/3 of the best possible split.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class PatchAssignment:
    ranks: list[list[int]]  # item indices per rank, ascending (each rank keeps batch order)
    loads: list[int]  # patches per rank

    @property
    def order(self) -> list[int]:
        """Item indices rank by rank: the order in which rank-major outputs arrive."""
        return [i for items in self.ranks for i in items]

    @property
    def inverse(self) -> list[int]:
        """``inverse[i]``: where item i sits in ``order``."""
        inv = [0] * len(self.order)
        for pos, i in enumerate(self.order):
            inv[i] = pos
        return inv


def balance_by_patches(patches: list[int], num_ranks: int) -> PatchAssignment:
    """Assign items (by their patch counts) to ``num_ranks`` ranks, heaviest first."""
    if num_ranks < 1:
        raise ValueError(f"num_ranks must be >= 1, got {num_ranks}")
    if any(p < 0 for p in patches):
        raise ValueError("patch counts must be >= 0")
    ranks: list[list[int]] = [[] for _ in range(num_ranks)]
    loads = [0] * num_ranks
    # NOTE: a stable sort on -patches keeps equal items in batch order: deterministic, so
    # every rank that recomputed this would agree (rank 0 sends it anyway).
    for i in sorted(range(len(patches)), key=lambda i: -patches[i]):
        r = min(range(num_ranks), key=lambda r: (loads[r], r))
        ranks[r].append(i)
        loads[r] += patches[i]
    return PatchAssignment([sorted(items) for items in ranks], loads)
