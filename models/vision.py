"""Vision towers of Qwen2-VL and Qwen2.5-VL (ViT over packed patches of many items).

Input rows are patches in the HF processor's order: per item, t-major, then merge windows
(merge x merge patches of one merged token are consecutive rows), so the merger simply
concatenates every ``merge**2`` consecutive rows. Attention runs inside each frame
(``cu_seqlens``); Qwen2.5-VL additionally runs most blocks inside windows of merged tokens.

Parameter names follow the checkpoints (``patch_embed.proj``, ``blocks.N.attn.qkv``, ...).

NOTE (devices): ``grid_thw`` stays on the host. Every index the tower derives from it
(patch coordinates, frame and window boundaries, window order) is computed there and sent
to the device once per call (``to_device``: pinned, non-blocking), together with the
longest segment; nothing is read back from the device.
"""
from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn
from triptych.engine.device.device_io import to_device
from triptych.kernels import get_ops


class Segments(NamedTuple):
    """Attention segments of a packed batch of patches: bidirectional inside each."""

    cu: torch.Tensor  # [N+1] int32 boundaries, on the device
    cu_cpu: np.ndarray  # the same on the host
    max_len: int  # the longest segment

    @classmethod
    def of(cls, cu: np.ndarray, device: torch.device) -> Segments:
        lens = np.diff(cu)
        return cls(to_device(torch.from_numpy(cu), device), cu,
                   int(lens.max()) if len(lens) else 0)


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


def host_grid(grid_thw: torch.Tensor | np.ndarray | list) -> np.ndarray:
    """The items' (t, h, w) as an [N, 3] int64 host array: the towers' index math runs on
    the host, in numpy (the engine hands the grid over as an array; a tensor is read once)."""
    if isinstance(grid_thw, np.ndarray):
        return grid_thw.astype(np.int64, copy=False).reshape(-1, 3)
    if isinstance(grid_thw, torch.Tensor):
        grid_thw = grid_thw.tolist()
    return np.asarray(grid_thw, dtype=np.int64).reshape(-1, 3)


def vision_positions(grid_thw: np.ndarray, merge: int) -> torch.Tensor:
    """(h, w) patch coordinates of every row, in merge-window order: [P, 2] int64, on the
    host.

        frame of h x w patches, merge 2:   rows run  (0,0) (0,1) (1,0) (1,1) | (0,2) (0,3) ...
    """
    out = []
    for t, h, w in host_grid(grid_thw).tolist():
        hh = np.broadcast_to(np.arange(h).reshape(h // merge, 1, merge, 1),
                             (h // merge, w // merge, merge, merge))
        ww = np.broadcast_to(np.arange(w).reshape(1, w // merge, 1, merge),
                             (h // merge, w // merge, merge, merge))
        hw = np.stack((hh.reshape(-1), ww.reshape(-1)), axis=-1)  # [h*w, 2]
        out.append(np.tile(hw, (t, 1)))
    return torch.from_numpy(np.concatenate(out).astype(np.int64))


def frame_cu_seqlens(grid_thw: np.ndarray) -> np.ndarray:
    """[num_frames + 1] int32 boundaries (host): every frame of every item attends within
    itself."""
    g = host_grid(grid_thw)
    lens = np.repeat(g[:, 1] * g[:, 2], g[:, 0])
    return np.concatenate(([0], np.cumsum(lens))).astype(np.int32)


def window_index(grid_thw: np.ndarray, merge: int, window: int
                 ) -> tuple[torch.Tensor, np.ndarray]:
    """Qwen2.5-VL window layout over merged tokens (on the host).

    Returns ``order`` [P / merge**2]: merged-token indices sorted window by window (row-major
    windows of ``window x window`` merged tokens per frame, edge windows smaller), and
    ``cu`` [num_windows + 1] int32: window boundaries in patch rows.
    """
    order, lens, base = [], [], 0
    for t, h, w in host_grid(grid_thw).tolist():
        gh, gw = h // merge, w // merge
        idx = np.arange(t * gh * gw).reshape(t, gh, gw)
        for ti in range(t):
            for r in range(0, gh, window):
                for c in range(0, gw, window):
                    win = idx[ti, r:r + window, c:c + window].reshape(-1)
                    order.append(win + base)
                    lens.append(win.size * merge * merge)
        base += t * gh * gw
    cu = np.concatenate(([0], np.cumsum(lens))).astype(np.int32)
    return torch.from_numpy(np.concatenate(order).astype(np.int64)), cu


class VisionAttention(nn.Module):
    def __init__(self, dim: int, num_heads: int, ops: Any) -> None:
        super().__init__()
        self.num_heads, self.head_dim = num_heads, dim // num_heads
        self.qkv = nn.Linear(dim, 3 * dim, bias=True)
        self.proj = nn.Linear(dim, dim, bias=True)
        self.ops = ops

    def forward(self, x: torch.Tensor, seg: Segments, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        # x: [P, dim]; cos/sin: [P, head_dim] fp32
        p = x.shape[0]
        q, k, v = self.qkv(x).view(p, 3, self.num_heads, self.head_dim).unbind(1)
        c, s = cos[:, None], sin[:, None]
        # NOTE: rotary in fp32, like HF's apply_rotary_pos_emb_vision
        q = (q.float() * c + rotate_half(q.float()) * s).to(x.dtype)
        k = (k.float() * c + rotate_half(k.float()) * s).to(x.dtype)
        o = self.ops.varlen_attention(q, k, v, seg.cu, self.head_dim ** -0.5,
                                      max_seqlen=seg.max_len, cu_seqlens_cpu=seg.cu_cpu)
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

    def forward(self, x: torch.Tensor, seg: Segments, cos: torch.Tensor,
                sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.norm1(x), seg, cos, sin)
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

    def rotary(self, grid_thw: np.ndarray, device: torch.device
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """cos/sin [P, head_dim] fp32 on ``device``: first quarter-dims rotate by h, next by
        w, repeated. The integer coordinates come from the host grid; the float math runs
        on the device, as HF's does."""
        q = self.head_dim // 4
        inv_freq = 1.0 / (self.rope_theta ** (torch.arange(0, 2 * q, 2, dtype=torch.float,
                                                           device=device) / (2 * q)))
        hw = to_device(vision_positions(grid_thw, self.merge), device)
        freqs = hw[..., None].float() * inv_freq  # [P, 2, q]
        freqs = freqs.flatten(1)  # [P, 2q] = [h freqs | w freqs]
        emb = torch.cat((freqs, freqs), dim=-1)
        return emb.cos(), emb.sin()

    def forward(self, pixel_values: torch.Tensor, grid_thw: np.ndarray | torch.Tensor
                ) -> torch.Tensor:
        """[num_patches, C*tps*ps*ps] -> [num_patches // merge**2, out_hidden], item order kept."""
        grid_thw = host_grid(grid_thw)
        w = self.patch_embed.proj.weight
        x = self.patch_embed.proj(pixel_values.to(w.dtype))  # [P, dim]
        cos, sin = self.rotary(grid_thw, x.device)
        seg = Segments.of(frame_cu_seqlens(grid_thw), x.device)
        for blk in self.blocks:
            x = blk(x, seg, cos, sin)
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

    def forward(self, pixel_values: torch.Tensor, grid_thw: np.ndarray | torch.Tensor
                ) -> torch.Tensor:
        grid_thw = host_grid(grid_thw)
        unit = self.merge * self.merge
        dev = self.patch_embed.proj.weight.device
        order, cu_win = window_index(grid_thw, self.merge, self.window)
        order = to_device(order, dev)

        def permute(t: torch.Tensor) -> torch.Tensor:  # [P, d] -> [P, d] in window order
            return t.view(-1, unit, t.shape[-1])[order].flatten(0, 1)

        w = self.patch_embed.proj.weight
        x = permute(self.patch_embed.proj(pixel_values.to(w.dtype)))  # [P, dim]
        cos, sin = (permute(t) for t in self.rotary(grid_thw, dev))
        full, win = Segments.of(frame_cu_seqlens(grid_thw), dev), Segments.of(cu_win, dev)
        for i, blk in enumerate(self.blocks):
            x = blk(x, full if i in self.fullatt else win, cos, sin)
        merged = self.merger(x)  # [P / unit, out] in window order
        return merged[torch.argsort(order)]
