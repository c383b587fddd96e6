"""Vision towers of Qwen2-VL and Qwen2.5-VL (ViT over packed patches of many items).

Input rows are patches in the HF processor's order: per item, t-major, then merge windows
(merge x merge patches of one merged token are consecutive rows), so the merger simply
concatenates every ``merge**2`` consecutive rows. Attention runs inside each frame
(``cu_seqlens``); Qwen2.5-VL additionally runs most blocks inside windows of merged tokens.

Parameter names follow the checkpoints (``patch_embed.proj``, ``blocks.N.attn.qkv``, ...).
"""
from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from triptych.kernels import get_ops


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-6) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def vision_positions(grid_thw: torch.Tensor, merge: int) -> torch.Tensor:
    """(h, w) patch coordinates of every row, in merge-window order: [P, 2] int64.

        frame of h x w patches, merge 2:   rows run  (0,0) (0,1) (1,0) (1,1) | (0,2) (0,3) ...
    """
    out = []
    for t, h, w in grid_thw.tolist():
        hh = torch.arange(h).view(h // merge, 1, merge, 1).expand(-1, w // merge, -1, merge)
        ww = torch.arange(w).view(1, w // merge, 1, merge).expand(h // merge, -1, merge, -1)
        hw = torch.stack((hh.reshape(-1), ww.reshape(-1)), dim=-1)  # [h*w, 2]
        out.append(hw.repeat(t, 1))
    return torch.cat(out).to(grid_thw.device)


def frame_cu_seqlens(grid_thw: torch.Tensor) -> torch.Tensor:
    """[num_frames + 1] int32 boundaries: every frame of every item attends within itself."""
    lens = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0])
    return F.pad(lens.cumsum(0), (1, 0)).to(torch.int32)


def window_index(grid_thw: torch.Tensor, merge: int, window: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Qwen2.5-VL window layout over merged tokens.

    Returns ``order`` [P / merge**2]: merged-token indices sorted window by window (row-major
    windows of ``window x window`` merged tokens per frame, edge windows smaller), and
    ``cu`` [num_windows + 1] int32: window boundaries in patch rows.
    """
    order, lens, base = [], [], 0
    for t, h, w in grid_thw.tolist():
        gh, gw = h // merge, w // merge
        idx = torch.arange(t * gh * gw).view(t, gh, gw)
        for ti in range(t):
            for r in range(0, gh, window):
                for c in range(0, gw, window):
                    win = idx[ti, r:r + window, c:c + window].reshape(-1)
                    order.append(win + base)
                    lens.append(win.numel() * merge * merge)
        base += t * gh * gw
    cu = F.pad(torch.tensor(lens).cumsum(0), (1, 0)).to(torch.int32)
    return torch.cat(order).to(grid_thw.device), cu.to(grid_thw.device)


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int, ops: Any) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim, bias=True)
        self.ops = ops

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        # x: [P, dim]; cos/sin: [P, head_dim] fp32
        p = x.shape[0]
        q, k, v = self.qkv(x).view(p, 3, self.num_heads, self.head_dim).unbind(1)
        c, s = cos[:, None], sin[:, None]
        # NOTE: rotary in fp32, like HF's apply_rotary_pos_emb_vision
        q = (q.float() * c + rotate_half(q.float()) * s).to(x.dtype)
        k = (k.float() * c + rotate_half(k.float()) * s).to(x.dtype)
        o = self.ops.varlen_attention(q, k, v, cu_seqlens, self.head_dim ** -0.5)
        return self.proj(o.reshape(p, -1))


class Qwen2VisionMLP(nn.Module):
    def __init__(self, dim: int, hidden: int) -> None:
        super().__init__()
        self.fc1 = nn.Linear(dim, hidden)
        self.fc2 = nn.Linear(hidden, dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.fc1(x)
        return self.fc2(h * torch.sigmoid(1.702 * h))  # quick_gelu


class SwiGLU(nn.Module):
    def __init__(self, dim: int, hidden: int, bias: bool) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(dim, hidden, bias=bias)
        self.up_proj = nn.Linear(dim, hidden, bias=bias)
        self.down_proj = nn.Linear(hidden, dim, bias=bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class VisionBlock(nn.Module):
    def __init__(self, norm1: nn.Module, norm2: nn.Module, attn: VisionAttention,
                 mlp: nn.Module) -> None:
        super().__init__()
        self.norm1, self.norm2, self.attn, self.mlp = norm1, norm2, attn, mlp

    def forward(self, x: torch.Tensor, cu_seqlens: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), cu_seqlens, cos, sin)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Concatenate each merge window's patches and project to the LM width."""

    def __init__(self, dim: int, out_dim: int, merge: int, norm: nn.Module) -> None:
        super().__init__()
        self.hidden = dim * merge * merge
        self.ln_q = norm
        self.mlp = nn.Sequential(nn.Linear(self.hidden, self.hidden), nn.GELU(),
                                 nn.Linear(self.hidden, out_dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.mlp(self.ln_q(x).view(-1, self.hidden))


class Qwen2VisionTransformer(nn.Module):
    """Qwen2-VL tower: LayerNorm blocks, quick_gelu MLP, full attention per frame."""

    def __init__(self, config: Any, attention_backend: str = "torch") -> None:
        super().__init__()
        self.ops = get_ops(attention_backend)
        self.merge = config.spatial_merge_size
        dim, out_dim = self._dims(config)
        self.num_heads = config.num_heads
        self.head_dim = dim // config.num_heads
        self.rope_theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", 10000.0)
        # Conv3d with kernel == stride over one patch is a linear map of the flattened patch;
        # the loader flattens the checkpoint's 5-D kernel into this [dim, C*tps*ps*ps] weight.
        patch_dim = config.in_channels * config.temporal_patch_size * config.patch_size ** 2
        self.patch_embed = nn.Module()
        self.patch_embed.proj = nn.Linear(patch_dim, dim, bias=False)
        self.blocks = nn.ModuleList([self._block(config, dim) for _ in range(config.depth)])
        self.merger = PatchMerger(dim, out_dim, self.merge, self._norm(dim))

    # -- architecture hooks (overridden by Qwen2.5-VL) --
    def _dims(self, config: Any) -> tuple[int, int]:
        return config.embed_dim, config.hidden_size

    def _norm(self, dim: int) -> nn.Module:
        return nn.LayerNorm(dim, eps=1e-6)

    def _block(self, config: Any, dim: int) -> VisionBlock:
        mlp = Qwen2VisionMLP(dim, int(dim * config.mlp_ratio))
        return VisionBlock(self._norm(dim), self._norm(dim),
                           VisionAttention(dim, config.num_heads, self.ops), mlp)

    def rotary(self, grid_thw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [P, head_dim] fp32: first quarter-dims rotate by h, next by w, repeated."""
        q = self.head_dim // 4
        inv_freq = 1.0 / (self.rope_theta ** (torch.arange(0, 2 * q, 2, dtype=torch.float,
                                                           device=grid_thw.device) / (2 * q)))
        freqs = vision_positions(grid_thw, self.merge)[..., None].float() * inv_freq  # [P, 2, q]
        freqs = freqs.flatten(1)  # [P, 2q] = [h freqs | w freqs]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """[num_patches, C*tps*ps*ps] -> [num_patches // merge**2, out_hidden], item order kept."""
        w = self.patch_embed.proj.weight
        x = self.patch_embed.proj(pixel_values.to(w.dtype))  # [P, dim]
        cos, sin = self.rotary(grid_thw)
        cu = frame_cu_seqlens(grid_thw)
        for blk in self.blocks:
            x = blk(x, cu, cos, sin)
        return self.merger(x)


class Qwen25VisionTransformer(Qwen2VisionTransformer):
    """Qwen2.5-VL tower: RMSNorm blocks, SwiGLU MLP, window attention except in
    ``fullatt_block_indexes``. Rows are permuted into window order (in units of whole merge
    windows, so the merger still sees intact groups) and restored after the merger."""

    def __init__(self, config: Any, attention_backend: str = "torch") -> None:
        super().__init__(config, attention_backend)
        self.fullatt = set(config.fullatt_block_indexes)
        # window_size is in pixels; windows are counted in merged tokens
        self.window = config.window_size // self.merge // config.patch_size

    def _dims(self, config: Any) -> tuple[int, int]:
        return config.hidden_size, config.out_hidden_size

    def _norm(self, dim: int) -> nn.Module:
        return RMSNorm(dim, eps=1e-6)

    def _block(self, config: Any, dim: int) -> VisionBlock:
        mlp = SwiGLU(dim, config.intermediate_size, bias=True)
        return VisionBlock(self._norm(dim), self._norm(dim),
                           VisionAttention(dim, config.num_heads, self.ops), mlp)

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        unit = self.merge * self.merge
        order, cu_win = window_index(grid_thw, self.merge, self.window)

        def permute(t: torch.Tensor) -> torch.Tensor:  # [P, d] -> [P, d] in window order
            return t.view(-1, unit, t.shape[-1])[order].flatten(0, 1)

        w = self.patch_embed.proj.weight
        x = permute(self.patch_embed.proj(pixel_values.to(w.dtype)))  # [P, dim]
        cos, sin = (permute(t) for t in self.rotary(grid_thw))
        cu_full = frame_cu_seqlens(grid_thw)
        for i, blk in enumerate(self.blocks):
            x = blk(x, cu_full if i in self.fullatt else cu_win, cos, sin)
        merged = self.merger(x)  # [P / unit, out] in window order
        return merged[torch.argsort(order)]
