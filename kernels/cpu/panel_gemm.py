"""Batched CPU GEMM on panel-packed fp32 / bf16 weights, and a row argmax (C++,
``csrc/cpu_panel_gemm.cpp``).

``pack(w)`` cuts a row-major [N, K] weight into K-major panels of 16 output columns once;
``gemm(x, panels, n, bias, threads)`` multiplies [M, K] fp32 rows by it (8 x 48 register
tiles of AVX-512 FMAs; bf16 with AVX512-BF16 pair dot products, x rounded to bf16 as
oneDNN's bf16 path does), fp32 out. ``kernels/cpu_linear.CpuGemm`` uses it in place of
oneDNN's packed inner product for fp32 / bf16 calls of more than the GEMV's rows when
``supported(fmt)`` (docs/performance.md, "Batch 32"). ``argmax(logits)`` is the sampler's
greedy fast path (engine/sampler.py).

Built on first use by ``cpu_build``; without a compiler, AVX-512 (fp32) or AVX512-BF16
(bf16) the libraries run. ``TRIPTYCH_CPU_PANEL_GEMM=0`` (env, read when a layer is
packed) keeps every batched GEMM on the libraries: an A/B switch for benchmarks.
"""
from __future__ import annotations

import logging
import os

import torch
from triptych.kernels.cpu import build as cpu_build

logger = logging.getLogger("triptych.cpu_panel_gemm")

LIBRARY = "cpu_panel_gemm"
BITS = {"float32": 32, "bfloat16": 16}
# one thread per this many logits (64 MiB): at batch 32 x 152k (19 MiB) a second thread
# cost more than it saved on the shared 2-core box (its wake-up and a busy core)
ARGMAX_MIN_ELEMENTS = 1 << 24

def loaded() -> bool:
    """The library is built and loaded here (logs once why not)."""
    return cpu_build.usable(LIBRARY, logger,
                            "the CPU panel GEMM is unavailable: batched CPU GEMMs use the "
                            "library kernels")


def supported(fmt: str) -> bool:
    """``fmt``'s panel GEMM runs on this CPU and ``TRIPTYCH_CPU_PANEL_GEMM`` is not 0."""
    if os.environ.get("TRIPTYCH_CPU_PANEL_GEMM", "1") == "0" or fmt not in BITS:
        return False
    return loaded() and bool(torch.ops.triptych_panel.supported(BITS[fmt]))


def pack(w: torch.Tensor) -> torch.Tensor:
    """[N, K] fp32 / bf16 -> panels (fp32 [ceil(N/16), K, 16]; bf16 [.., ceil(K/2), 16, 2])."""
    return torch.ops.triptych_panel.pack(w.contiguous())


def gemm(x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None,
         threads: int) -> torch.Tensor:
    """[M, K] fp32 x panels of an [n, K] weight -> [M, n] fp32 on up to ``threads`` threads."""
    groups = -(-panels.shape[0] // 3)  # 3 panels (48 columns) per register tile
    grain = max(1, -(-groups // max(1, threads)))
    return torch.ops.triptych_panel.gemm(x, panels, n, bias, grain)


def gemm_argmax(x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None,
                threads: int) -> torch.Tensor:
    """argmax(gemm(x, panels, n, bias), -1) as [M] int64 without making the [M, n] logits
    (fp32 panels): greedy tokens straight from the LM head."""
    groups = -(-panels.shape[0] // 3)
    grain = max(1, -(-groups // max(1, threads)))
    return torch.ops.triptych_panel.gemm_argmax(x, panels, n, bias, grain)


def argmax(logits: torch.Tensor) -> torch.Tensor:
    """[M, V] fp32 -> [M] int64, torch.argmax's result (first maximum; NaN wins)."""
    m = logits.shape[0]
    threads = max(1, min(torch.get_num_threads(), logits.numel() // ARGMAX_MIN_ELEMENTS))
    return torch.ops.triptych_panel.argmax(logits, max(1, -(-m // threads)))
