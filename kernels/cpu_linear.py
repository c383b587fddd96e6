"""CPU linear layers on weights packed once for oneDNN, each GEMM on the threads it pays for.

``pack_linears(model)`` runs after a model is loaded on the CPU in fp32 (``cpu_gemm="onednn"``,
the default): every ``nn.Linear`` of the model (fused q|k|v and gate|up included) keeps
its weight in oneDNN's blocked layout, reordered once, and runs through oneDNN with dense
inputs and outputs. The LM head packs its own copy (``CpuGemm`` in ``compute_logits``).

Why (docs/performance.md, 2-core AMD EPYC with AVX-512, torch 2.13 CPU wheel):
- torch's CPU ``F.linear`` is MKL sgemm, which on this AMD host ran at 30-90 GFLOP/s on
  the shapes of a decode step; oneDNN on a packed weight ran the same GEMMs 2-3x faster
  (e.g. 32x256 @ 256x1376: 260 -> 120 us; a 152k-row LM head at M=64: 98 -> 38 ms) and a
  3,200-token prefill GEMM 2.3x faster.
- Waking an idle OpenMP thread costs ~100 us on this VM under the passive wait policy
  (worker/threads.py), more than a small GEMM's whole run on one core. So each call picks
  its thread count from its size: one thread per ``min_flops_per_thread`` of work, at most
  the process's threads. With a spinning wait policy (the user set OMP_WAIT_POLICY=ACTIVE
  or GOMP_SPINCOUNT) wake-ups are cheap and the bar is much lower.
  NOTE: torch's thread count is process-wide; the switch is safe because a worker runs
  its model from one thread (nothing else in the process issues torch ops meanwhile).

Outputs differ from ``F.linear`` by float rounding only (another summation order), like
any change of GEMM library; greedy outputs stay equal to HF in the parity tests.
"""
from __future__ import annotations

import logging
import os
import types
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger("triptych.cpu_linear")

PACK_HINT_ROWS = 32  # oneDNN picks the blocked layout for about this many rows (any M works)
MIN_FLOPS_PASSIVE = 24e6  # ~130 us of one core's GEMM: worth a ~100 us thread wake-up
MIN_FLOPS_SPINNING = 2e6


def available() -> bool:
    """oneDNN's packed linear is in this torch build (x86 CPU wheels have it)."""
    return bool(torch.backends.mkldnn.is_available()) and \
        hasattr(torch.ops.mkldnn, "_reorder_linear_weight") and \
        hasattr(torch.ops.mkldnn, "_linear_pointwise")


def min_flops_per_thread(env: Any = None) -> float:
    """Work (FLOPs) below which one more thread costs more than it saves.

    ``TRIPTYCH_CPU_GEMM_MIN_FLOPS`` overrides; else it follows the OpenMP wait policy this
    process started with (threads.py sets PASSIVE unless the user chose theirs)."""
    env = os.environ if env is None else env
    value = env.get("TRIPTYCH_CPU_GEMM_MIN_FLOPS")
    if value:
        return float(value)
    passive = env.get("OMP_WAIT_POLICY", "").upper() == "PASSIVE" and \
        "GOMP_SPINCOUNT" not in env
    return MIN_FLOPS_PASSIVE if passive else MIN_FLOPS_SPINNING


class CpuGemm:
    """y = x @ W^T (+ b) with W packed for oneDNN; x [..., K] fp32 on the CPU."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None,
                 min_flops: float | None = None) -> None:
        self.out_features, self.in_features = weight.shape
        self.packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach().contiguous(),
                                                              PACK_HINT_ROWS)
        self.bias = None if bias is None else bias.detach().contiguous()
        self.min_flops = min_flops_per_thread() if min_flops is None else min_flops

    def threads(self, rows: int, most: int) -> int:
        """Threads for a GEMM of ``rows`` rows: one per ``min_flops`` of work, 1..most."""
        flops = 2.0 * rows * self.in_features * self.out_features
        return max(1, min(most, int(flops // self.min_flops)))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        most = torch.get_num_threads()
        want = self.threads(x.numel() // max(1, self.in_features), most)
        if want == most:
            return self._run(x)
        torch.set_num_threads(want)
        try:
            return self._run(x)
        finally:
            torch.set_num_threads(most)

    def _run(self, x: torch.Tensor) -> torch.Tensor:
        if not x.is_contiguous():
            x = x.contiguous()
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")


def _packed_forward(self: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return self.cpu_gemm(x)


def eligible(module: nn.Module) -> bool:
    """A plain (or fused) linear layer with an fp32 CPU weight. Row-parallel layers (their
    own forward, an all-reduce after the GEMM) call ``cpu_gemm`` themselves when set."""
    w = getattr(module, "weight", None)
    return isinstance(module, nn.Linear) and isinstance(w, torch.Tensor) and \
        w.device.type == "cpu" and w.dtype == torch.float32 and w.dim() == 2 and w.numel() > 0


def pack_linears(model: nn.Module, skip: tuple[str, ...] = ("lm_head",)) -> int:
    """Pack every eligible linear layer of ``model`` in place; returns how many.

    The dense weight is released (the packed copy replaces it; ``weight`` becomes an empty
    tensor of the same dtype, so code that reads ``.weight.dtype`` still works and code
    that would multiply by it fails loudly). Layers named in ``skip`` keep their weight
    (the LM head: ``compute_logits`` reads it, possibly tied to the embedding)."""
    if not available():
        logger.info("oneDNN packed linear is not in this torch build: linear layers use "
                    "torch's F.linear")
        return 0
    min_flops = min_flops_per_thread()
    n = 0
    for name, module in model.named_modules():
        if name.split(".")[-1] in skip or not eligible(module):
            continue
        # A layer with its own forward (row-parallel: all-reduce, then the bias) calls
        # ``linear`` for the bare GEMM and keeps its bias.
        own = type(module).forward is not nn.Linear.forward
        bias = None if own else module.bias
        module.cpu_gemm = CpuGemm(module.weight, bias, min_flops)
        if not own:
            module.forward = types.MethodType(_packed_forward, module)
        module.weight = nn.Parameter(module.weight.new_empty(0), requires_grad=False)
        if bias is not None:
            module.bias = nn.Parameter(bias.new_empty(0), requires_grad=False)
        n += 1
    return n


def linear(module: nn.Linear, x: torch.Tensor) -> torch.Tensor:
    """x @ W^T of a layer with its own forward: packed when ``pack_linears`` packed it."""
    gemm = getattr(module, "cpu_gemm", None)
    return F.linear(x, module.weight) if gemm is None else gemm(x)
