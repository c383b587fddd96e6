"""Linear layers that hold one rank's slice of a weight, and where checkpoint tensors land.

    column-parallel  y[:, cols of rank r] = x @ W[rows of rank r].T        (no communication)
    row-parallel     y = all_reduce_r( x[:, cols of rank r] @ W[:, cols of rank r].T ) + b
    vocab-parallel   embedding rows [r*V/N, (r+1)*V/N) on rank r; ids outside give zeros,
                     one all-reduce sums the ranks' rows into every token's embedding

A Megatron pair (column-parallel, then row-parallel) costs one all-reduce: the activation
between them stays sharded. ``FusedLinear`` is the single-rank layer whose rows stack
several checkpoint tensors (q|k|v, gate|up); its column-parallel form keeps each part's
slice of rank r, so a fused GEMM stays one GEMM per rank.

Every layer here answers ``shards(prefix)``: for each checkpoint tensor (our parameter
naming, see checkpoint_names.map_checkpoint_name) the pieces of it this rank reads, and where they
go. The loader reads exactly those slices from safetensors, never the whole tensor.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

if TYPE_CHECKING:  # the type only: models stand below parallel/
    from triptych.parallel.context import TPContext


@dataclass(frozen=True)
class Shard:
    """One piece of a checkpoint tensor that this rank loads.

    param: our parameter receiving it; rows: its row range in that parameter (None: all);
    dim / src: the range of the checkpoint tensor's ``dim`` to read (src None: all of it);
    full: that dim's size in the checkpoint (checked before slicing).
    """

    param: str
    rows: tuple[int, int] | None = None
    dim: int = 0
    src: tuple[int, int] | None = None
    full: int | None = None
    dst_dim: int = 0  # the parameter's dim that ``rows`` ranges over (stacked experts: 1)


@dataclass(frozen=True)
class Part:
    """A block of output rows of a fused / column-parallel layer.

    name: the checkpoint tensor's module name beside the fused one (``q_proj`` next to
    ``qkv_proj``), or None for the layer's own tensor; local: rows this rank holds;
    start / full: where they begin in that checkpoint tensor, and its row count.
    """

    name: str | None
    local: int
    start: int
    full: int


def _sibling(prefix: str, name: str | None) -> str:
    return prefix if name is None else prefix.rsplit(".", 1)[0] + "." + name


class FusedLinear(nn.Linear):
    """nn.Linear whose rows stack several checkpoint tensors, on one rank or sharded by
    columns across ranks (each part contributes its rank's slice, parts stay in order)."""

    def __init__(self, in_features: int, parts: list[Part], bias: bool) -> None:
        super().__init__(in_features, sum(p.local for p in parts), bias=bias)
        self.parts = parts

    @classmethod
    def single(cls, in_features: int, named_sizes: list[tuple[str, int]], bias: bool
               ) -> FusedLinear:
        return cls(in_features, [Part(n, s, 0, s) for n, s in named_sizes], bias)

    def shards(self, prefix: str) -> dict[str, list[Shard]]:
        out: dict[str, list[Shard]] = {}
        row = 0
        kinds = ("weight", "bias") if self.bias is not None else ("weight",)
        for p in self.parts:
            for kind in kinds:
                src = None if (p.start, p.local) == (0, p.full) else (p.start, p.start + p.local)
                out.setdefault(f"{_sibling(prefix, p.name)}.{kind}", []).append(
                    Shard(f"{prefix}.{kind}", (row, row + p.local), 0, src, p.full))
            row += p.local
        return out


def rank_part(name: str | None, rows: int, ctx: TPContext, *, offset: int = 0,
              ckpt_rows: int | None = None, replicas: int = 1) -> Part:
    """Rank r's slice of ``rows`` output rows (found at ``offset`` in a checkpoint tensor of
    ``ckpt_rows`` rows). ``replicas`` consecutive ranks share one slice: KV heads fewer than
    ranks are replicated, rank r holding head ``r // replicas``."""
    local = rows * replicas // ctx.size
    return Part(name, local, offset + ctx.rank // replicas * local, ckpt_rows or rows)


class RowParallelLinear(nn.Linear):
    """Input columns split across ranks; partial products summed by one all-reduce. The
    bias (whole on every rank) is added once, after the sum."""

    def __init__(self, in_features: int, out_features: int, bias: bool, ctx: TPContext) -> None:
        super().__init__(in_features // ctx.size, out_features, bias=bias)
        self.ctx, self.full_in = ctx, in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [N, in / size] -> [N, out]
        # the bare GEMM: packed when a CPU engine packed this layer (kernels/cpu/linear.py
        # sets ``cpu_gemm``), else torch's
        gemm = getattr(self, "cpu_gemm", None)
        y = self.ctx.all_reduce(F.linear(x, self.weight) if gemm is None else gemm(x))
        return y if self.bias is None else y + self.bias

    def shards(self, prefix: str) -> dict[str, list[Shard]]:
        n = self.in_features
        return {f"{prefix}.weight": [Shard(f"{prefix}.weight", None, 1,
                                           (self.ctx.rank * n, (self.ctx.rank + 1) * n),
                                           self.full_in)]}


class VocabParallelEmbedding(nn.Module):
    """Rows [rank * V/N, (rank+1) * V/N) of the embedding; ``weight`` is that slice (the
    tied LM head reads it to make this rank's slice of the logits)."""

    def __init__(self, vocab: int, hidden: int, ctx: TPContext) -> None:
        super().__init__()
        self.ctx, self.vocab = ctx, vocab
        self.num_local = vocab // ctx.size
        self.start = ctx.rank * self.num_local
        self.weight = nn.Parameter(torch.empty(self.num_local, hidden))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        # ids: [T] -> [T, hidden]
        local = ids - self.start
        outside = (local < 0) | (local >= self.num_local)
        out = F.embedding(local.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside[:, None], 0)
        return self.ctx.all_reduce(out)

    def shards(self, prefix: str) -> dict[str, list[Shard]]:
        return {f"{prefix}.weight": [Shard(f"{prefix}.weight", None, 0,
                                           (self.start, self.start + self.num_local),
                                           self.vocab)]}
