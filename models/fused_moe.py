"""Mixture-of-experts MLP over a flat batch: route, sort by expert, one GEMM pair per expert.

    x [T, H] --router--> top-k experts and weights per token
    the T*k (token, expert) pairs sorted by expert (stable: tokens keep their order)
        pairs:   e0 e0 e0 | e1 | e3 e3 ...          contiguous slice per expert
    per expert with tokens: [n, H] @ gate_up[e].T -> silu(gate) * up -> @ down[e].T
    outputs scaled by their routing weight, summed back per token (index_add, expert order)

The work is proportional to the routed tokens: an expert nobody picked costs nothing, and
no Python loop runs per token (the loop is over the experts that have tokens, each one a
GEMM over its whole slice). The per-token sum runs in ascending expert order, as HF's
Qwen3-VL-MoE experts add their outputs, so fp32 results match it closely.

The loop reads the per-expert counts back (one device read a layer), so a GPU cannot
capture it in a CUDA graph. Where the backend offers a grouped GEMM that takes the
per-expert offsets on the device (``ops.grouped_mm_for``: ``torch._grouped_mm`` in bf16 on
sm90/sm100, kernels/choice.py), ``grouped_experts`` runs the same pairs in two GEMMs and
reads nothing back; the torch and cpu backends keep the loop.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn
from triptych.kernels import torch_ref
from triptych.models.parallel_layers import Shard

if TYPE_CHECKING:  # the type only: models stand below parallel/
    from triptych.parallel.context import TPContext


def route(x: torch.Tensor, gate_weight: torch.Tensor, top_k: int
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """(expert ids [T, k] int64, weights [T, k] in x's dtype): softmax in fp32 over the
    router logits, top-k, renormalised to sum to 1 (Qwen3-VL-MoE's router)."""
    logits = F.linear(x, gate_weight)
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    weights = weights / weights.sum(dim=-1, keepdim=True)
    return ids, weights.to(logits.dtype)


def fused_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                  ids: torch.Tensor, weights: torch.Tensor,
                  silu_and_mul: Callable[[torch.Tensor, int], torch.Tensor]
                  = torch_ref.silu_and_mul) -> torch.Tensor:
    """[T, H] -> [T, H]: every token through its k experts, weighted and summed.

    gate_up: [E, 2 * I, H] (gate rows then up rows), down: [E, H, I]; ``silu_and_mul``:
    the backend's activation (``ops.silu_and_mul``, signature of torch_ref's)."""
    k = ids.shape[1]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert
    token = order // k  # the token of each sorted pair
    counts = torch.bincount(flat, minlength=gate_up.shape[0]).tolist()  # one host sync
    xs = x[token]  # [T*k, H], expert-contiguous
    out = torch.empty_like(xs)
    inter = down.shape[-1]
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        seg = xs[start:start + n]
        gu = F.linear(seg, gate_up[e])
        out[start:start + n] = F.linear(silu_and_mul(gu, inter), down[e])
        start += n
    out = out * weights.reshape(-1)[order, None]
    return torch.zeros_like(x).index_add_(0, token, out.to(x.dtype))


def grouped_experts(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor,
                    ids: torch.Tensor, weights: torch.Tensor,
                    grouped_mm: Callable[..., torch.Tensor],
                    silu_and_mul: Callable[[torch.Tensor, int], torch.Tensor]
                    = torch_ref.silu_and_mul) -> torch.Tensor:
    """``fused_experts`` with no device read: the sorted pairs go through each expert in
    one grouped GEMM per projection, the per-expert boundaries staying on the device.

        sorted expert ids:  0 0 0 1 3 3       offs (end of each expert's rows): 3 4 4 6

    ``grouped_mm(a [M, K], b [E, K, N], offs [E] int32) -> [M, N]`` (torch._grouped_mm)."""
    k, num_experts = ids.shape[1], gate_up.shape[0]
    flat = ids.reshape(-1)
    order = torch.argsort(flat, stable=True)  # pairs grouped by expert
    token = order // k
    # NOTE: searchsorted, not bincount: CUDA's bincount reads its input's max back
    experts = torch.arange(num_experts, device=flat.device, dtype=flat.dtype)
    offs = torch.searchsorted(flat[order], experts, right=True, out_int32=True)
    xs = x[token]  # [T*k, H], expert-contiguous
    gu = grouped_mm(xs, gate_up.transpose(1, 2), offs=offs)  # [T*k, 2I]
    out = grouped_mm(silu_and_mul(gu, down.shape[-1]), down.transpose(1, 2), offs=offs)
    out = out * weights.reshape(-1)[order, None]
    return torch.zeros_like(x).index_add_(0, token, out.to(x.dtype))


class SparseMoeBlock(nn.Module):
    """Parameter names as HF's checkpoints: ``gate.weight`` [E, H] and the stacked
    ``experts.gate_up_proj`` [E, 2I, H] / ``experts.down_proj`` [E, H, I]. ``ops``: the
    kernel backend (``kernels.get_ops``), whose ``silu_and_mul`` the experts use."""

    def __init__(self, hidden: int, inter: int, num_experts: int, top_k: int,
                 ops: Any) -> None:
        super().__init__()
        self.top_k, self.ops = top_k, ops
        self.gate = nn.Module()
        self.gate.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.experts = nn.Module()
        self.experts.gate_up_proj = nn.Parameter(torch.empty(num_experts, 2 * inter, hidden))
        self.experts.down_proj = nn.Parameter(torch.empty(num_experts, hidden, inter))

    @property
    def reads_back(self) -> bool:
        """The experts read per-expert counts back each forward (no CUDA graph)."""
        w = self.experts.down_proj
        return self.ops.grouped_mm_for(w.dtype, w.device) is None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        ids, weights = route(x, self.gate.weight, self.top_k)
        gate_up, down = self.experts.gate_up_proj, self.experts.down_proj
        gmm = self.ops.grouped_mm_for(x.dtype, x.device)
        if gmm is not None:
            return grouped_experts(x, gate_up, down, ids, weights, gmm, self.ops.silu_and_mul)
        return fused_experts(x, gate_up, down, ids, weights, self.ops.silu_and_mul)


class ShardedMoeBlock(SparseMoeBlock):
    """Rank r's slice of every expert's intermediate dim: gate|up rows (column-parallel)
    and down columns (row-parallel), so each rank's partial outputs sum to the whole in
    one all-reduce. The router is whole on every rank (every rank routes alike)."""

    def __init__(self, hidden: int, inter: int, num_experts: int, top_k: int, ops: Any,
                 ctx: TPContext) -> None:
        super().__init__(hidden, inter // ctx.size, num_experts, top_k, ops)
        self.ctx, self.full_inter = ctx, inter

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.ctx.all_reduce(super().forward(x))

    def shards(self, prefix: str) -> dict[str, list[Shard]]:
        i, r, full = self.full_inter // self.ctx.size, self.ctx.rank, self.full_inter
        gu, dn = f"{prefix}.experts.gate_up_proj", f"{prefix}.experts.down_proj"
        return {gu: [Shard(gu, (0, i), 1, (r * i, (r + 1) * i), 2 * full, dst_dim=1),
                     Shard(gu, (i, 2 * i), 1, (full + r * i, full + (r + 1) * i), 2 * full,
                           dst_dim=1)],
                dn: [Shard(dn, None, 2, (r * i, (r + 1) * i), full)]}
