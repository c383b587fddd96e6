"""mm_encoder_tp_mode="data": every rank holds the whole vision tower and encodes its share of
the batch's items (patch-balanced, parallel/patch_balance.py); rank 0 gathers the outputs and
puts them back in batch order.

    items        0 (900 patches)   1..5 (64 each)            2 ranks
    rank 0       tower([0])        -> [225, D]  --+
    rank 1       tower([1..5])     -> [80, D]   --+-- gather (padded to 225 rows) on rank 0
    rank 0       split by item, ``inverse`` back to batch order -> [e0, e1, ..., e5]

Gathered to rank 0 only, not all-gathered: rank 0 owns the encoder cache and sends each
step's vision rows (cache hits included) with the step, so the other ranks never need the
tower's output. Each item's embedding is the same whichever rank computes it: the towers'
attention never crosses items, so a share encodes exactly as inside the whole batch.
"""
from __future__ import annotations

from collections.abc import Callable

import torch
from triptych.parallel.patch_balance import PatchAssignment
from triptych.parallel.context import TPContext

# (pixel_values [P, patch_dim], grid_thw [N, 3]) -> one [rows_i, out_dim] tensor per item
EncodeFn = Callable[[torch.Tensor, torch.Tensor], list[torch.Tensor]]


def item_rows(grid: torch.Tensor, merge: int) -> list[int]:
    """Embedding rows of each item: t * h * w / merge**2."""
    return (grid.prod(-1) // merge ** 2).tolist()


def rank_pixels(pixels: torch.Tensor, grid: torch.Tensor, items: list[int]) -> torch.Tensor:
    """The pixel rows of ``items`` (in the order given) from a batch's packed pixels."""
    counts = grid.prod(-1).tolist()
    starts = [0]
    for c in counts:
        starts.append(starts[-1] + c)
    if not items:
        return pixels[:0]
    return torch.cat([pixels[starts[i]:starts[i + 1]] for i in items])


def encode_data_parallel(encode_fn: EncodeFn, ctx: TPContext, grid: torch.Tensor,
                         assignment: PatchAssignment, pixels: torch.Tensor, merge: int,
                         out_dim: int, dtype: torch.dtype) -> list[torch.Tensor] | None:
    """Encode this rank's items (``pixels``: theirs only, in batch order) and gather.

    Returns every item's embedding in batch order on rank 0, None on the other ranks."""
    rows = item_rows(grid, merge)
    mine = assignment.ranks[ctx.rank]
    # pixels: [sum of my items' patches, patch_dim] -> local: [sum of my rows, out_dim]
    if mine:
        local = torch.cat(encode_fn(pixels, grid[mine]))
    else:
        local = torch.empty(0, out_dim, dtype=dtype, device=pixels.device)
    per_rank = [sum(rows[i] for i in items) for items in assignment.ranks]
    # NOTE: gather needs one shape on every rank: pad to the busiest rank's rows
    padded = torch.zeros(max(per_rank), out_dim, dtype=local.dtype, device=local.device)
    padded[:local.shape[0]] = local
    got = ctx.gather(padded)
    if got is None:
        return None
    in_order = []  # embeddings in ``assignment.order`` (rank by rank)
    for r, items in enumerate(assignment.ranks):
        start = 0
        for i in items:
            in_order.append(got[r][start:start + rows[i]])
            start += rows[i]
    return [in_order[j] for j in assignment.inverse]
