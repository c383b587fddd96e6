"""M-RoPE position ids of a prompt, from the router's placeholder ranges (Qwen2-VL family).

Every prompt token gets three position ids (temporal, height, width). Text tokens use the
same running index on all three axes; the tokens of one image/video item lay their merged
patch grid out from the running index ``p`` at the item's start:

    item grid (t, h, w) after the spatial merge, e.g. t=2, h=2, w=3, interval=i:
        temporal: p + floor(ti * i)     for ti in 0..t-1   (i = 1 for images and Qwen2-VL)
        height:   p + hi                for hi in 0..h-1
        width:    p + wi                for wi in 0..w-1
    tokens run t-major, then h, then w; afterwards p += max(h, w)  (NOT t: HF 5.x rule)

Decode tokens (index >= len(prompt)) use ``index + delta`` on all three axes, where
``delta = max(prompt positions) + 1 - len(prompt)``.

This equals ``get_rope_index`` of transformers 5.23 on the same prompt. That one groups
runs of equal ``mm_token_type_ids``; here each item is its own span (so two items with no
text between them still get their own grids, where HF would swallow both into one group).
"""
from __future__ import annotations

import torch
from triptych.engine.request import MMItem


def compute_mrope_positions(
    num_tokens: int,
    mm_items: list[MMItem],
    spatial_merge_size: int,
    tokens_per_second: float | None,
) -> tuple[torch.Tensor, int]:
    """Positions ``[3, num_tokens]`` (int64) of a prompt and its decode ``delta``.

    ``tokens_per_second`` is the vision config's value (Qwen2.5-VL); None (Qwen2-VL) spaces
    video frames by 1. A video's ``second_per_grid_t`` defaults to 1.0 like HF's.
    """
    m = spatial_merge_size
    parts: list[torch.Tensor] = []  # each [3, n]
    pos = 0  # running position id
    cursor = 0  # next token index to place
    for it in sorted(mm_items, key=lambda x: x.offset):
        if it.offset < cursor or it.end > num_tokens:
            raise ValueError(f"{it.modality} placeholder [{it.offset}, {it.end}) overlaps another "
                             f"item or runs past the prompt ({num_tokens} tokens)")
        n_text = it.offset - cursor
        if n_text:
            parts.append((torch.arange(n_text) + pos).expand(3, -1))
            pos += n_text
        t, h, w = int(it.grid_thw[0]), int(it.grid_thw[1]) // m, int(it.grid_thw[2]) // m
        if t * h * w != it.length:
            raise ValueError(f"{it.modality} grid {tuple(it.grid_thw)} with merge {m} gives "
                             f"{t * h * w} tokens, but its placeholder has {it.length}")
        parts.append(_grid_positions(t, h, w, pos, _time_interval(it, tokens_per_second)))
        pos += max(h, w)
        cursor = it.end
    if num_tokens > cursor:
        parts.append((torch.arange(num_tokens - cursor) + pos).expand(3, -1))
    if not parts:
        return torch.zeros(3, 0, dtype=torch.long), 0
    positions = torch.cat(parts, dim=1)
    delta = int(positions.max()) + 1 - num_tokens
    return positions, delta


def _time_interval(it: MMItem, tokens_per_second: float | None) -> float | torch.Tensor:
    """Temporal position step per grid frame."""
    if it.modality != "video" or tokens_per_second is None:
        return 1
    # NOTE: HF multiplies in float32 (second_per_grid_ts comes from the processor as a float32
    # tensor) and truncates with .long(); doing the same keeps the floor identical.
    spg = 1.0 if it.second_per_grid_t is None else it.second_per_grid_t
    return torch.tensor(spg, dtype=torch.float32) * tokens_per_second


def _grid_positions(t: int, h: int, w: int, start: int,
                    interval: float | torch.Tensor) -> torch.Tensor:
    """[3, t*h*w] positions of one item's merged grid, offset by ``start``."""
    tt = (torch.arange(t) * interval).long() + start
    hh = torch.arange(h) + start
    ww = torch.arange(w) + start
    grid = torch.meshgrid(tt, hh, ww, indexing="ij")
    return torch.stack(grid).reshape(3, -1)
