"""Batched CPU GEMM on panel-packed fp32 / bf16 weights, and a row argmax (C++,
``csrc/cpu_panel_gemm/``).

``pack(w)`` cuts a row-major [N, K] weight into K-major panels of 16 output columns once
(the same layout for every variant); ``gemm(x, panels, n, bias, threads)`` multiplies
[M, K] fp32 rows by it in register tiles: AVX-512 8 x 48 (bf16 with AVX512-BF16 pair dot
products, x rounded to bf16 as oneDNN's bf16 path does), AVX2 6 x 16 (bf16 weights widened
in registers, x in fp32), fp32 out. ``kernels/cpu_linear.CpuGemm`` uses it where the
platform chose panels for a format (``isa.CpuKernels.batched``: fp32 wherever AVX2 runs,
bf16 where oneDNN's bf16 does not; docs/performance.md, "Batch 32" and "AVX2-only CPUs").
``argmax(logits)`` is the sampler's greedy fast path and ``draw`` its random rows' one
call (engine/sample/sampler.py).

Built on first use by ``cpu_build`` (one copy per instruction set, ``isa.py``); without a
compiler the libraries run. ``TRIPTYCH_CPU_PANEL_GEMM=0`` (env, read when a layer is packed)
keeps every batched GEMM on the libraries where one runs the format: an A/B switch for
benchmarks.
"""
from __future__ import annotations

import functools
import logging
import os

import torch
from triptych.kernels.cpu import build as cpu_build
from triptych.kernels.cpu import isa

logger = logging.getLogger("triptych.cpu_panel_gemm")

LIBRARY = "cpu_panel_gemm"
FORMATS = ("float32", "bfloat16")
# one thread per this many logits (64 MiB): at batch 32 x 152k (19 MiB) a second thread
# cost more than it saved on the shared 2-core box (its wake-up and a busy core)
ARGMAX_MIN_ELEMENTS = 1 << 24


def loaded() -> bool:
    """The library is built and loaded here (logs once why not)."""
    return cpu_build.usable(LIBRARY, logger,
                            "the CPU panel GEMM is unavailable: batched CPU GEMMs use the "
                            "library kernels")


def switched_off() -> bool:
    """``TRIPTYCH_CPU_PANEL_GEMM=0``: the A/B switch back to the libraries."""
    return os.environ.get("TRIPTYCH_CPU_PANEL_GEMM", "1") == "0"


def supported(fmt: str) -> bool:
    """The panel GEMM is built here, takes ``fmt`` and is not switched off."""
    return fmt in FORMATS and not switched_off() and loaded()


@functools.cache
def _built() -> tuple[int, ...]:
    return tuple(torch.ops.triptych_panel.variants())


def variant_id() -> int:
    """The variant this process runs (the platform's choice, as far as this build holds it)."""
    return isa.variant_id(LIBRARY, _built())


def pack(w: torch.Tensor) -> torch.Tensor:
    """[N, K] fp32 / bf16 -> panels (fp32 [ceil(N/16), K, 16]; bf16 [.., ceil(K/2), 16, 2])."""
    return torch.ops.triptych_panel.pack(w.contiguous())


def gemm(x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None,
         threads: int, variant: int | None = None) -> torch.Tensor:
    """[M, K] fp32 x panels of an [n, K] weight -> [M, n] fp32 on up to ``threads`` threads
    (``variant``, an ``isa.NAMES`` index: another copy than the platform's; tests)."""
    return torch.ops.triptych_panel.gemm(x, panels, n, bias, threads,
                                         variant_id() if variant is None else variant)


def gemm_argmax(x: torch.Tensor, panels: torch.Tensor, n: int, bias: torch.Tensor | None,
                threads: int, variant: int | None = None) -> torch.Tensor:
    """argmax(gemm(x, panels, n, bias), -1) as [M] int64 without making the [M, n] logits
    (fp32 panels): greedy tokens straight from the LM head."""
    return torch.ops.triptych_panel.gemm_argmax(x, panels, n, bias, threads,
                                                variant_id() if variant is None else variant)


def draw(logits: torch.Tensor, rows: torch.Tensor, temperature: torch.Tensor,
         u: torch.Tensor, ids: torch.Tensor, variant: int | None = None) -> torch.Tensor:
    """``ids`` with each of ``rows`` drawn from softmax(logits[row] / temperature) at its
    uniform ``u`` (the inverse CDF, fp64), in place: the sampler's plain random rows."""
    threads = max(1, min(torch.get_num_threads(), logits.numel() // ARGMAX_MIN_ELEMENTS))
    torch.ops.triptych_panel.draw(logits, rows, temperature, u, ids, threads,
                                  variant_id() if variant is None else variant)
    return ids


def argmax(logits: torch.Tensor, variant: int | None = None) -> torch.Tensor:
    """[M, V] fp32 -> [M] int64, torch.argmax's result (first maximum; NaN wins)."""
    threads = max(1, min(torch.get_num_threads(), logits.numel() // ARGMAX_MIN_ELEMENTS))
    return torch.ops.triptych_panel.argmax(logits, threads,
                                           variant_id() if variant is None else variant)
