"""Fused paged-decode attention for the CPU (C++, ``csrc/cpu_paged_attention/``).

Same contract as ``torch_ref.paged_decode_attention``; K/V are read in place from their
cache blocks through the block table instead of being gathered into a contiguous copy
for SDPA (that gather was half the OCR preset's decode forward, docs/performance.md).
Built on first use by ``cpu_build`` (once per machine, cached, a copy per instruction set:
``isa.py``; each call runs the variant the platform chose); ``available()`` says whether
that worked here and logs why not.

Threads: the work items are (sequence, KV head) pairs on torch's intra-op threads. A call
takes one thread per ``MIN_KV_BYTES_PER_THREAD`` of K/V it reads, up to the process's
threads; the C++ side runs inline when one thread is enough. Why 4 MiB (~400 us of one
core's reads, 4x what waking a thread costs under the passive wait policy): on the shared
2-core box (docs/performance.md) a 2-thread region waits for a descheduled peer whenever
the host is busy, and the OCR preset's decode attention (5.7 MB per layer) spent 64-66%
of the decode forward on 2 threads vs 41-42% on one (same runs, load ~11-17); the decode
step's other ops (GEMMs under 24 MFLOP, norms) are single-threaded already.
"""
from __future__ import annotations

import functools
import logging
import os
from typing import NamedTuple

import torch
from triptych.kernels.cpu import build as cpu_build
from triptych.kernels.cpu import isa

logger = logging.getLogger("triptych.cpu_attention")

LIBRARY = "cpu_paged_attention"
DTYPES = (torch.float32, torch.bfloat16, torch.float16)
MIN_KV_BYTES_PER_THREAD = 4 << 20  # ~400 us of one core's reads: see the module docstring

def available() -> bool:
    """The kernel is built and loaded in this process (built now on first call)."""
    return cpu_build.usable(LIBRARY, logger,
                            "the fused CPU paged attention is unavailable, using the slower "
                            "torch gather + SDPA path instead")


@functools.cache
def _built() -> tuple[int, ...]:
    return tuple(torch.ops.triptych_cpu.variants())


def variant_id() -> int:
    """The variant this process runs (the platform's choice, as far as this build holds it)."""
    return isa.variant_id(LIBRARY, _built())


class CpuDecodePlan(NamedTuple):
    """What every layer's decode attention shares in one forward pass."""

    block_tables: torch.Tensor  # [B, max_blocks] int32, contiguous
    seq_lens: torch.Tensor  # [B] int32, contiguous
    num_tokens: int  # sum of seq_lens: K/V rows every layer reads


def decode_plan(block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int,
                max_seq_len: int | None = None) -> CpuDecodePlan:
    """The tables in the kernel's dtype, once per forward (not once per layer); the CPU
    kernel needs no maximum length (``max_seq_len`` is accepted for the common call)."""
    lens = seq_lens.to(torch.int32).contiguous()
    return CpuDecodePlan(block_tables.to(torch.int32).contiguous(), lens, int(lens.sum()))


def grain(num_items: int, kv_bytes: int, most: int) -> int:
    """Work items per thread: one thread per ``MIN_KV_BYTES_PER_THREAD`` of K/V read
    (``TRIPTYCH_CPU_ATTN_MIN_BYTES`` overrides), at most ``most`` threads."""
    min_bytes = float(os.environ.get("TRIPTYCH_CPU_ATTN_MIN_BYTES", MIN_KV_BYTES_PER_THREAD))
    threads = max(1, min(most, int(kv_bytes // max(min_bytes, 1.0))))
    return max(1, -(-num_items // threads))


def paged_decode_attention(
    q: torch.Tensor,  # [B, H, D]: one query token per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,  # [B, max_blocks] int32
    seq_lens: torch.Tensor,  # [B] int32: context length including the query token
    scale: float,
    plan: CpuDecodePlan | None = None,  # per-forward tables and thread split (decode_plan)
    variant: int | None = None,  # an isa.NAMES index: another copy than the platform's (tests)
) -> torch.Tensor:  # [B, H, D]
    """Attention of one new token per sequence over its paged context (GQA: the H / Hkv
    query heads of a KV head share each K/V row read). fp32 / bf16 / fp16, fp32 math."""
    _, bs, hkv, d = k_cache.shape
    if q.dtype not in DTYPES or k_cache.dtype != q.dtype or v_cache.dtype != q.dtype:
        raise ValueError(f"paged_decode_attention: q {q.dtype} and the KV cache "
                         f"{k_cache.dtype}/{v_cache.dtype} must share one of {DTYPES}")
    if q.dim() != 3 or q.shape[2] != d or q.shape[1] % hkv:
        raise ValueError(f"paged_decode_attention: q {tuple(q.shape)} does not fit the KV "
                         f"cache {tuple(k_cache.shape)} (q must be [B, H, D], H % Hkv == 0)")
    if plan is None:
        plan = decode_plan(block_tables, seq_lens, bs)
    kv_bytes = plan.num_tokens * 2 * hkv * d * k_cache.element_size()
    items = grain(q.shape[0] * hkv, kv_bytes, torch.get_num_threads())
    return torch.ops.triptych_cpu.paged_decode_attention(
        q.contiguous(), k_cache, v_cache, plan.block_tables, plan.seq_lens, scale, items,
        variant_id() if variant is None else variant)


paged_decode_attention.make_plan = decode_plan  # type: ignore[attr-defined]
