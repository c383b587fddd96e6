"""Skinny CPU GEMM for decode steps of 1-2 rows (C++, ``csrc/cpu_gemv/``).

``gemv(x, w, scale, bias, threads)``: y = x @ w^T (* scale per output row) (+ bias) for x
[M, K] fp32 and a row-major w [N, K] in fp32, bf16, fp16 or int8 (``scale``: one fp32 per
row, required for int8), fp32 accumulation and out; int8 quantizes each x row to 8 bits
(one scale per row) and multiplies in exact int32 sums (VNNI where the CPU has it, AVX2's
vpmaddubsw otherwise: the same bits either way). One build holds a copy per instruction
set (``isa.py``); each call runs the variant the platform chose. ``kernels/cpu_linear.CpuGemm``
sends its calls of at most ``GEMV_MAX_ROWS[fmt]`` rows here (fp32 / bf16: 2, int8: 1,
fp16: none, fbgemm's is as fast) and keeps the libraries' packed GEMMs for more rows
(measured per format: docs/performance.md, "Where the batch-1 step's time goes").

Built on first use by ``cpu_build`` (once per machine, cached); ``available()`` says
whether that worked here and logs why not. ``TRIPTYCH_CPU_GEMV=0`` turns it off (every
call goes to the libraries: an A/B switch for benchmarks, read when a layer is packed).
"""
from __future__ import annotations

import functools
import logging
import os

import torch
from triptych.kernels.cpu import build as cpu_build
from triptych.kernels.cpu import isa

logger = logging.getLogger("triptych.cpu_gemv")

LIBRARY = "cpu_gemv"
DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.int8)

def enabled() -> bool:
    """``TRIPTYCH_CPU_GEMV`` is not 0 and the kernel is built and loaded here."""
    if os.environ.get("TRIPTYCH_CPU_GEMV", "1") == "0":
        return False
    return cpu_build.usable(LIBRARY, logger,
                            "the CPU GEMV kernel is unavailable: batch-1 decode GEMMs use the "
                            "slower library kernels")


def variant_id() -> int:
    """The variant this process runs (the platform's choice, as far as this build holds it)."""
    return isa.variant_id(LIBRARY, _built())


@functools.cache
def _built() -> tuple[int, ...]:
    return tuple(torch.ops.triptych_gemv.variants())


def row_sums(w: torch.Tensor) -> torch.Tensor:
    """[N] int32 sums of an int8 weight's rows (the VNNI path's offset correction)."""
    return w.sum(dim=1, dtype=torch.int32).contiguous()


def gemv(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor | None,
         bias: torch.Tensor | None, threads: int, wsum: torch.Tensor | None = None,
         variant: int | None = None) -> torch.Tensor:
    """[M, K] fp32 x [N, K] w -> [M, N] fp32 on up to ``threads`` threads (1: inline).
    int8 ``w`` needs ``scale`` and ``wsum`` (``row_sums(w)``, taken once). ``variant``
    (an ``isa.NAMES`` index; tests): another copy than the platform's choice."""
    if w.dtype not in DTYPES:
        raise ValueError(f"gemv: weight dtype {w.dtype} is not one of {DTYPES}")
    n = w.shape[0]
    grain = max(1, -(-n // max(1, threads)))
    return torch.ops.triptych_gemv.gemv(x, w, scale, bias, wsum, grain,
                                        variant_id() if variant is None else variant)
