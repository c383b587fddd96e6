"""The CPU kernels' instruction-set copies this machine runs, for the kernel tests: each
test runs every copy the CPU runs (kernels/cpu/isa.py), so an AVX-512 box tests the AVX2
and portable copies too; ``TRIPTYCH_CPU_ISA=avx2`` runs the whole suite as an AVX2-only
box would (engine/device/cpu_features.py)."""
from __future__ import annotations

from triptych.engine.device.platform import cpu_kernels
from triptych.kernels.cpu import isa

KERNELS = cpu_kernels()  # the platform's choice for this CPU, as the engine makes it


def runnable(built: tuple[int, ...]) -> list[int]:
    """The copies of a library's ``built`` ones (its ``variants()``) this CPU runs."""
    return [v for v in built if v <= KERNELS.variant_id]


def ids(variants: list[int]) -> list[str]:
    return [isa.NAMES[v] for v in variants]
