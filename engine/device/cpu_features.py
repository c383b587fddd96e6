"""What this CPU offers, read once: the platform seam's (engine/device/platform.py) one source of
CPU flags, and the switch that makes a CPU look like a lesser one.

``TRIPTYCH_CPU_ISA`` (environment; read here only): ``native`` (the default: every flag
the CPU reports), ``avx512`` or ``avx2``. ``avx2`` hides every AVX-512 flag, AMX, AVX-VNNI
and AVX-NE-CONVERT: the engine then chooses, builds and runs what an AVX2 / FMA / F16C-only
CPU gets, so one AVX-512 box tests both kinds (``avx512`` hides AVX512-BF16, VNNI and AMX:
a Skylake-class CPU). The libraries torch runs read their own caps once, at their first
use in a process, so ``apply_switch`` (called when ``triptych`` is imported, before any
torch op runs) exports the matching ones for this process and its children, unless the
user set them:

    TRIPTYCH_CPU_ISA   ONEDNN_MAX_CPU_ISA   ATEN_CPU_CAPABILITY   FBGEMM_ / MKL_ENABLE_INSTRUCTIONS
    avx512             AVX512_CORE          avx512                AVX512
    avx2               AVX2                 avx2                  AVX2

(checked: with ``ONEDNN_MAX_CPU_ISA=AVX2`` oneDNN refuses bf16 weights exactly as on an
AVX2-only CPU, ``torch.backends.cpu.get_cpu_capability()`` says AVX2, and fbgemm's int8
GEMM saturates without ``reduce_range`` as without VNNI.)
"""
from __future__ import annotations

import functools
import os
import platform as _platform
from collections.abc import MutableMapping
from dataclasses import dataclass

SWITCH = "TRIPTYCH_CPU_ISA"
LEVELS = ("native", "avx512", "avx2")
# the flags that decide a path here (/proc/cpuinfo's names), in the order the log names them
KNOWN = ("avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512dq", "avx512_bf16",
         "avx512_vnni", "avx_vnni", "avx_ne_convert", "amx_tile", "amx_bf16", "amx_int8")
# what each level hides: flags starting with one of these
_HIDES = {"native": (), "avx512": ("avx512_bf16", "avx512_vnni", "avx512_fp16", "avx_vnni",
                                   "avx_ne_convert", "amx"),
          "avx2": ("avx512", "avx10", "amx", "avx_vnni", "avx_ne_convert", "avx_ifma",
                   "avx_vnni_int8")}
LIBRARY_CAPS = {
    "avx512": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE", "ATEN_CPU_CAPABILITY": "avx512",
               "FBGEMM_ENABLE_INSTRUCTIONS": "AVX512", "MKL_ENABLE_INSTRUCTIONS": "AVX512"},
    "avx2": {"ONEDNN_MAX_CPU_ISA": "AVX2", "ATEN_CPU_CAPABILITY": "avx2",
             "FBGEMM_ENABLE_INSTRUCTIONS": "AVX2", "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
}


@dataclass(frozen=True)
class CpuFeatures:
    """The CPU as the engine sees it (after ``TRIPTYCH_CPU_ISA``)."""

    model: str
    flags: frozenset[str]  # what the engine may use
    level: str  # TRIPTYCH_CPU_ISA: native | avx512 | avx2
    hidden: frozenset[str]  # flags the CPU has that the level hides

    def has(self, *names: str) -> bool:
        return all(n in self.flags for n in names)

    def summary(self) -> str:
        """One line for the start-up log and the benchmarks' records."""
        shown = " ".join(f for f in KNOWN if f in self.flags) or "none of avx2/fma/avx512"
        line = f"{self.model}: {shown}"
        if self.level != "native":
            known_hidden = [f for f in KNOWN if f in self.hidden]
            line += (f" ({SWITCH}={self.level}: hides " +
                     (" ".join(known_hidden) if known_hidden else "nothing this CPU has") + ")")
        return line


def level(env: MutableMapping[str, str] | None = None) -> str:
    """``TRIPTYCH_CPU_ISA``, checked."""
    value = (os.environ if env is None else env).get(SWITCH, "native").strip().lower() or "native"
    if value not in LEVELS:
        raise ValueError(f"{SWITCH}={value!r}: use one of {', '.join(LEVELS)}")
    return value


def apply_switch(env: MutableMapping[str, str] | None = None) -> None:
    """Export the libraries' own caps for ``TRIPTYCH_CPU_ISA`` (a variable the user set
    wins). Must run before torch's first op in the process: each library reads its cap once."""
    env = os.environ if env is None else env
    for name, value in LIBRARY_CAPS.get(level(env), {}).items():
        env.setdefault(name, value)


def _read_cpuinfo() -> tuple[str, set[str]]:
    model, flags = "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key == "model name" and not model:
                    model = value.strip()
                elif key in ("flags", "Features") and not flags:  # x86, arm64
                    flags = set(value.split())
    except OSError:  # not Linux: no flags, the portable kernels
        pass
    return model or _platform.processor() or _platform.machine(), flags


def features(model: str, flags: set[str] | frozenset[str], lvl: str) -> CpuFeatures:
    """A CPU reporting ``flags``, as the engine sees it at level ``lvl``."""
    hidden = {f for f in flags if f.startswith(_HIDES[lvl])}
    return CpuFeatures(model, frozenset(set(flags) - hidden), lvl, frozenset(hidden))


@functools.cache
def detect() -> CpuFeatures:
    """This CPU, once per process, under ``TRIPTYCH_CPU_ISA``."""
    return features(*_read_cpuinfo(), level())
