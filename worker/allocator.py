"""Allocator policy: keep freed memory in the process instead of handing it back every step.

Every process that runs torch applies it at start, through ``apply_thread_policy``.

Why (docs/performance.md, measured on the 2-core dev box, glibc malloc, torch 2.13 CPU):
glibc serves a request above its mmap threshold (128 KiB, raised as large blocks are
freed) with a fresh ``mmap``, and gives the top of the heap back to the kernel whenever
more than the trim threshold is free. A decode step allocates and frees the same few MB
of activations and gathered K/V every layer; with the defaults those pages went back to
the kernel and came back zeroed, one page fault at a time: the OCR preset's paged
attention call took 2.9 ms instead of 0.3 ms, and ~20% of the benchmark's CPU time was
spent in the kernel. Fixing the mmap threshold at its 32 MiB maximum and trimming only
beyond 1 GiB keeps those pages mapped; memory freed after a peak stays with the process
(up to the trim threshold), as it would with tcmalloc or jemalloc, which vLLM recommends
on CPU.

Whose choice wins: a user who tuned glibc (``MALLOC_*_`` variables, ``GLIBC_TUNABLES``)
or preloaded another allocator (``LD_PRELOAD`` tcmalloc / jemalloc / mimalloc) keeps it;
``TRIPTYCH_MALLOC_POLICY=default`` leaves glibc's defaults alone.
"""
from __future__ import annotations

import ctypes
import logging
import os
import sys

logger = logging.getLogger("triptych.allocator")

M_TRIM_THRESHOLD = -1  # mallopt parameters (glibc <malloc.h>)
M_MMAP_THRESHOLD = -3
MMAP_THRESHOLD = 32 * 1024 * 1024  # glibc's maximum on 64-bit: larger blocks still mmap
TRIM_THRESHOLD = 1024 * 1024 * 1024  # give the heap's top back only when this much is free
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


def apply_allocator_policy() -> bool:
    """Set glibc's mmap and trim thresholds for this process (once); True when set."""
    global _applied
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
        bool(mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD))
    return _applied
