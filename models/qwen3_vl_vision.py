"""Qwen3-VL's vision tower: ViT with a learned position grid, and DeepStack mergers.

Differences from Qwen2.5-VL's tower (vision.py), as HF's Qwen3VLVisionModel computes them:

    patch embedding   Conv3d with bias (patch 16): a linear map of the flattened patch
    + position        a learned side x side grid, bilinearly resampled (align_corners) to
                      each item's h x w patch grid and added to the patch embeddings
    blocks            LayerNorm, full attention per frame, MLP linear_fc1 -> act -> fc2
    DeepStack         after each block in ``deepstack_visual_indexes`` a merger of its own
                      (LayerNorm *after* the 2x2 shuffle) maps the hidden states to the
                      LM width: one more [rows, out_hidden] tensor per listed block

``forward`` returns one payload ``[rows, out_hidden * (1 + len(deepstack))]`` for the
whole batch: the final merger's rows, then each DeepStack merger's (models/contract.py).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from triptych.engine.device.device_io import to_device
from triptych.kernels import get_ops
from triptych.models.vision import (
    Qwen2VisionTransformer,
    Segments,
    VisionAttention,
    VisionBlock,
    frame_cu_seqlens,
    host_grid,
    vision_positions,
)

_ACTS = {"gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu,
         "silu": F.silu, "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x)}


class Qwen3VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int, act: str) -> None:
        super().__init__()
        if act not in _ACTS:
            raise ValueError(f"vision hidden_act {act!r} is not one of {sorted(_ACTS)}")
        self.linear_fc1 = nn.Linear(dim, hidden)
        self.linear_fc2 = nn.Linear(hidden, dim)
        self.act = _ACTS[act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Qwen3PatchMerger(nn.Module):
    """2x2 shuffle + MLP to the LM width. ``postshuffle``: the LayerNorm runs over the
    shuffled (merge**2 * dim) rows (DeepStack mergers), else over each patch first."""

    def __init__(self, dim: int, out_dim: int, merge: int, postshuffle: bool) -> None:
        super().__init__()
        self.hidden = dim * merge * merge
        self.postshuffle = postshuffle
        self.norm = nn.LayerNorm(self.hidden if postshuffle else dim, eps=1e-6)
        self.linear_fc1 = nn.Linear(self.hidden, self.hidden)
        self.linear_fc2 = nn.Linear(self.hidden, out_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.norm(x.view(-1, self.hidden)) if self.postshuffle else \
            self.norm(x).view(-1, self.hidden)
        return self.linear_fc2(F.gelu(self.linear_fc1(x)))


def bilinear_taps(grid_thw: np.ndarray, merge: int, side: int, device: torch.device
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """Four (index, weight) taps per patch row into a ``side x side`` table, resampling it
    to each item's (h, w) grid like ``F.interpolate(bilinear, align_corners=True)``; rows
    in merge-window order. Returns idx [P, 4] int64, weights [P, 4] fp32, on ``device``
    (the integer coordinates from the host grid, the float math on the device)."""
    hw = to_device(vision_positions(grid_thw, merge), device).float()  # [P, 2] patch (h, w)
    g = host_grid(grid_thw)
    sizes = to_device(torch.from_numpy(np.repeat(g[:, 1:], g[:, 0] * g[:, 1] * g[:, 2], axis=0)),
                      device).float()
    src = hw * (side - 1) / torch.clamp(sizes - 1, min=1)  # [P, 2] source coordinates
    lo = src.floor()
    taps = (lo[..., None] + torch.arange(2, device=src.device)).clamp(0, side - 1)  # [P, 2, 2]
    wts = (1 - (src[..., None] - lo[..., None] - torch.arange(2, device=src.device)).abs()
           ).clamp(min=0)
    idx = (taps[:, 0, :, None] * side + taps[:, 1, None, :]).reshape(-1, 4).long()
    weight = (wts[:, 0, :, None] * wts[:, 1, None, :]).reshape(-1, 4)
    return idx, weight


class Qwen3VisionTransformer(nn.Module):
    """The tower; parameter names follow HF's checkpoints (``model.visual.*``)."""

    def __init__(self, config: Any, attention_backend: str = "torch") -> None:
        super().__init__()
        self.ops = get_ops(attention_backend)
        self.merge = config.spatial_merge_size
        dim, out_dim = config.hidden_size, config.out_hidden_size
        self.num_heads, self.head_dim = config.num_heads, dim // config.num_heads
        self.rope_theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta",
                                                                               10000.0)
        self.side = int(config.num_position_embeddings ** 0.5)
        self.deepstack_indexes = list(config.deepstack_visual_indexes)
        patch_dim = config.in_channels * config.temporal_patch_size * config.patch_size ** 2
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Linear(patch_dim, dim, bias=True)  # Conv3d, flattened
        self.pos_embed = nn.Embedding(config.num_position_embeddings, dim)
        self.blocks = nn.ModuleList([
            VisionBlock(nn.LayerNorm(dim, eps=1e-6), nn.LayerNorm(dim, eps=1e-6),
                        VisionAttention(dim, config.num_heads, self.ops),
                        Qwen3VisionMLP(dim, config.intermediate_size, config.hidden_act))
            for _ in range(config.depth)])
        self.merger = Qwen3PatchMerger(dim, out_dim, self.merge, postshuffle=False)
        self.deepstack_merger_list = nn.ModuleList([
            Qwen3PatchMerger(dim, out_dim, self.merge, postshuffle=True)
            for _ in self.deepstack_indexes])

    # The 2-D rotary of the blocks is Qwen2-VL's (head_dim/4 frequencies per axis).
    rotary = Qwen2VisionTransformer.rotary

    def forward(self, pixel_values: torch.Tensor, grid_thw: np.ndarray | torch.Tensor
                ) -> torch.Tensor:
        """[num_patches, C*tps*ps*ps] -> payload [num_patches // merge**2, out * (1 + k)]."""
        grid_thw = host_grid(grid_thw)
        w = self.patch_embed.proj.weight
        x = self.patch_embed.proj(pixel_values.to(w.dtype))  # [P, dim]
        idx, weight = bilinear_taps(grid_thw, self.merge, self.side, x.device)
        pos = (self.pos_embed(idx) * weight[:, :, None]).sum(1)  # fp32 weights, as HF
        x = x + pos.to(x.dtype)
        cos, sin = self.rotary(grid_thw, x.device)
        seg = Segments.of(frame_cu_seqlens(grid_thw), x.device)
        deepstack = []
        for i, blk in enumerate(self.blocks):
            x = blk(x, seg, cos, sin)
            if i in self.deepstack_indexes:
                merger = self.deepstack_merger_list[self.deepstack_indexes.index(i)]
                deepstack.append(merger(x))
        return torch.cat([self.merger(x), *deepstack], dim=-1)
