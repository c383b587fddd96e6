"""The CPU kernels' instruction-set variants, and which of them this process runs.

Every C++ library in ``csrc/`` is one build holding a variant of its kernels per
instruction set (``build.py`` compiles ``csrc/<lib>/kernels.cpp`` once per variant the
compiler supports, with that variant's flags and never ``-march=native``); each call names
the variant it runs. The variants are ordered: each needs every CPU flag of the one before.

    variant       compiled with                     CPU flags it needs (/proc/cpuinfo names)
    generic       the compiler's defaults           -
    avx2          -mavx2 -mfma -mf16c               avx2 fma f16c
    avx512        + -mavx512f/bw/vl/dq              + avx512f avx512bw avx512vl avx512dq
    avx512_bf16   + -mavx512bf16 -mavx512vnni       + avx512_bf16 avx512_vnni

Which variant runs, and which kernel serves each weight format, is the platform's decision
(``engine/device/platform.py`` reads the CPU once and calls ``choose``): this package never reads
CPU flags itself. A kernel called before the platform has chosen raises, naming what to call.
"""
from __future__ import annotations

from dataclasses import dataclass, field

# name -> (compiler flags, CPU flags it needs); each entry extends the one before
VARIANTS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {}
_flags: tuple[str, ...] = ()
_needs: tuple[str, ...] = ()
for _name, _more_flags, _more_needs in (
        ("generic", (), ()),
        ("avx2", ("-mavx2", "-mfma", "-mf16c"), ("avx2", "fma", "f16c")),
        ("avx512", ("-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq"),
         ("avx512f", "avx512bw", "avx512vl", "avx512dq")),
        ("avx512_bf16", ("-mavx512bf16", "-mavx512vnni"), ("avx512_bf16", "avx512_vnni"))):
    _flags, _needs = _flags + _more_flags, _needs + _more_needs
    VARIANTS[_name] = (_flags, _needs)
NAMES = tuple(VARIANTS)  # index = the id the C++ ops take


def best_variant(cpu_flags: frozenset[str] | set[str]) -> str:
    """The last variant whose CPU flags are all in ``cpu_flags``."""
    return [n for n, (_, needs) in VARIANTS.items() if set(needs) <= cpu_flags][-1]


@dataclass(frozen=True)
class CpuKernels:
    """The platform's choice for this CPU (``engine/device/platform.cpu_kernels``)."""

    variant: str  # the best variant this CPU runs (a library built without it runs the next)
    # the batched (more rows than the GEMV's) path of each weight format: panels (ours,
    # kernels/cpu/panel_gemm.py), onednn or fbgemm (through torch)
    batched: dict[str, str] = field(default_factory=dict)
    # fbgemm's int8 GEMM multiplies with AVX-512 VNNI here: full 8-bit activations (without
    # it, vpmaddubsw's 16-bit pair sums saturate: 7-bit activations, ``reduce_range``)
    int8_vnni: bool = False

    @property
    def variant_id(self) -> int:
        return NAMES.index(self.variant)


_chosen: CpuKernels | None = None
_resolved: dict[tuple[str, tuple[int, ...]], int] = {}


def choose(kernels: CpuKernels) -> None:
    """The platform's choice for this process (the same every time it is asked)."""
    global _chosen
    if kernels.variant not in VARIANTS:
        raise ValueError(f"unknown CPU kernel variant {kernels.variant!r}: one of {NAMES}")
    _chosen = kernels
    _resolved.clear()


def chosen() -> CpuKernels:
    if _chosen is None:
        raise RuntimeError("the CPU kernels run the variant the platform chose for this CPU: "
                           "call triptych.engine.device.platform.cpu_kernels() first")
    return _chosen


def variant_id(library: str, built: tuple[int, ...]) -> int:
    """The variant ``library`` runs: the best one it was built with that this CPU runs
    (``built``: the ids the library holds, its ``variants()`` op)."""
    key = (library, built)
    if key not in _resolved:
        top = chosen().variant_id
        runs = [v for v in built if v <= top]
        if not runs:
            raise RuntimeError(f"{library} holds no variant this CPU runs (built: "
                               f"{[NAMES[v] for v in built]}, CPU: {NAMES[top]})")
        _resolved[key] = max(runs)
    return _resolved[key]
