"""Allocator policy: keep the memory a step frees for the next step, and no more.

Every process that runs torch applies it at start, through ``apply_thread_policy``; a
worker's loop then sizes the retention to what its steps need (``StepTrim``).

Why (docs/performance.md, measured on the 2-core dev box, glibc malloc, torch 2.13 CPU):
glibc serves a request above its mmap threshold (128 KiB, raised as large blocks are
freed) with a fresh ``mmap``, and gives the top of the heap back to the kernel whenever
more than the trim threshold is free. A decode step allocates and frees the same few MB
of activations and gathered K/V every layer; with the defaults those pages went back to
the kernel and came back zeroed, one page fault at a time: the OCR preset's paged
attention call took 2.9 ms instead of 0.3 ms, and ~20% of the benchmark's CPU time was
spent in the kernel. Fixing the mmap threshold at its 32 MiB maximum keeps those blocks
on the heap, and a trim threshold above what a step frees keeps their pages mapped.

How much to keep (the trim threshold: free memory at the heap's top beyond it goes back to
the kernel): a fixed 1 GiB let every process keep up to 1 GiB it had freed (a soak of
1e1p1d: P0 +260 MB over glibc's defaults; 2e2p2d could hold 7 GiB). Now it starts at
TRIM_FLOOR (64 MiB), and a worker's loop trims what is free beyond it after steps and
sizes it to TRIM_FACTOR x what the steps then fault back in (``StepTrim``), capped at
TRIM_CEILING: a decode step's few MB stay mapped, a rare huge prefill's peak goes back.
The API process runs no steps and keeps glibc's defaults (``steps=False``).

oneDNN's caches (the packed CPU GEMMs, kernels/cpu/linear.py) are bounded here too: ideep's
LRU of computations and oneDNN's primitive cache hold one entry per input shape, 1,024 by
default, a few hundred KB each. A prefill worker sees a new token count almost every step
and kept ~300 MB more after 1,500 requests, still growing (docs/performance.md);
ONEDNN_CACHE_ENTRIES (256) covers the shapes of decode batches and a prefill's recent ones.
A user's own ``LRU_CACHE_CAPACITY`` / ``ONEDNN_PRIMITIVE_CACHE_CAPACITY`` wins.

Whose choice wins: a user who tuned glibc (``MALLOC_*_`` variables, ``GLIBC_TUNABLES``)
or preloaded another allocator (``LD_PRELOAD`` tcmalloc / jemalloc / mimalloc) keeps it;
``TRIPTYCH_MALLOC_POLICY=default`` leaves glibc's defaults alone.
"""
from __future__ import annotations

import ctypes
import logging
import os
import resource
import sys

logger = logging.getLogger("triptych.allocator")

M_TRIM_THRESHOLD = -1  # mallopt parameters (glibc <malloc.h>)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's maximum on 64-bit: larger blocks still mmap
TRIM_FLOOR = 64 << 20  # the trim threshold at start, and its least value
TRIM_CEILING = 1 << 30  # its most (the old fixed value)
TRIM_FACTOR = 2  # kept: this many times the most a recent step left free
TRIM_EVERY = 16  # steps between two reads of mallinfo2 (it walks the free lists)
PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096
ONEDNN_CACHE_ENTRIES = "256"  # ideep's LRU and oneDNN's primitive cache, each
ONEDNN_CACHE_VARS = ("LRU_CACHE_CAPACITY", "ONEDNN_PRIMITIVE_CACHE_CAPACITY")
USER_VARS = ("MALLOC_TRIM_THRESHOLD_", "MALLOC_MMAP_THRESHOLD_", "MALLOC_TOP_PAD_",
             "GLIBC_TUNABLES")
OTHER_ALLOCATORS = ("tcmalloc", "jemalloc", "mimalloc")

_applied: bool | None = None


def allocator_choice(env: dict[str, str] | os._Environ) -> str | None:
    """Why the policy should not be applied (None: apply it)."""
    if env.get("TRIPTYCH_MALLOC_POLICY", "") == "default":
        return "TRIPTYCH_MALLOC_POLICY=default"
    user = [v for v in USER_VARS if v in env]
    if user:
        return f"{user[0]} is set"
    preload = env.get("LD_PRELOAD", "")
    other = [a for a in OTHER_ALLOCATORS if a in preload]
    if other:
        return f"{other[0]} is preloaded"
    if not sys.platform.startswith("linux"):
        return "not Linux (glibc)"
    return None


def bound_onednn_caches(env: dict[str, str] | os._Environ) -> None:
    """Entries of oneDNN's per-shape caches, unless the user chose (read at their first use,
    so in time before the first GEMM; workers inherit it)."""
    for var in ONEDNN_CACHE_VARS:
        env.setdefault(var, ONEDNN_CACHE_ENTRIES)


def apply_allocator_policy(steps: bool = True) -> bool:
    """Set glibc's mmap and trim thresholds for this process (once); True when set.

    ``steps`` False (the API process, which runs no engine steps): only oneDNN's caches are
    bounded; glibc keeps its defaults, under which P0 stayed flat in the soak while the
    fixed thresholds let it keep ~170 MB more per 1,000 requests (freed image buffers)."""
    global _applied
    bound_onednn_caches(os.environ)
    if not steps:
        return False
    if _applied is not None:
        return _applied
    why_not = allocator_choice(os.environ)
    _applied = False
    if why_not is not None:
        logger.debug("allocator policy not applied: %s", why_not)
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):  # musl and others have no mallopt
        logger.debug("allocator policy not applied: no mallopt in this C library")
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    _applied = bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD)) and \
        bool(mallopt(M_TRIM_THRESHOLD, TRIM_FLOOR))
    return _applied


class _MallInfo2(ctypes.Structure):  # glibc >= 2.33 <malloc.h>
    _fields_ = [(name, ctypes.c_size_t) for name in (
        "arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks",
        "fordblks", "keepcost")]


class StepTrim:
    """The retention of a stepping process, sized by what its steps take back after a trim.

    ``after_step()`` every step; every TRIM_EVERY steps it reads the bytes the heap holds
    free (``mallinfo2().fordblks``). Beyond the threshold (at first TRIM_FLOOR) they go
    back to the kernel (``malloc_trim``: the heap's top and whole free pages inside it).
    The steps after a trim fault their working set back in: those page faults (minor
    faults, ``getrusage``) size the threshold, TRIM_FACTOR x that working set within
    [TRIM_FLOOR, TRIM_CEILING], also given to glibc as its trim threshold. So a decode
    step's few MB stay mapped, and a rare huge step's peak is returned after it.
    Does nothing where the policy is not applied (the user's allocator choice) or glibc
    has no mallinfo2."""

    def __init__(self) -> None:
        self.threshold = TRIM_FLOOR
        self.trims = 0
        self.working_set = 0  # bytes the steps after the last trim faulted back in
        self._steps = 0
        self._faults_at_trim: int | None = None
        self._libc = None
        if _applied:
            libc = ctypes.CDLL(None)
            if hasattr(libc, "mallinfo2") and hasattr(libc, "malloc_trim"):
                libc.mallinfo2.restype = _MallInfo2
                libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
                libc.malloc_trim.argtypes = [ctypes.c_size_t]
                self._libc = libc

    def free_bytes(self) -> int:
        return int(self._libc.mallinfo2().fordblks) if self._libc else 0

    def after_step(self) -> None:
        if self._libc is None:
            return
        self._steps += 1
        if self._steps % TRIM_EVERY:
            return
        if self._faults_at_trim is not None:  # the steps since the trim took this back
            self.working_set = (_minor_faults() - self._faults_at_trim) * PAGE
            self._faults_at_trim = None
            want = min(max(TRIM_FACTOR * self.working_set, TRIM_FLOOR), TRIM_CEILING)
            if want != self.threshold:
                self._libc.mallopt(M_TRIM_THRESHOLD, want)
                self.threshold = want
        if self.free_bytes() > self.threshold:
            self._libc.malloc_trim(0)
            self.trims += 1
            self._faults_at_trim = _minor_faults()


def _minor_faults() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt
