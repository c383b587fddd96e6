"""Which kernel each phase of a forward runs, decided here and logged once at start-up.

    phase                        torch / cpu backends          triton backend
    decode                       torch paged SDPA / C++        Triton paged decode
    prefill, no cached prefix    torch paged (unchanged)       the step's fresh q/k/v, causal:
                                                               SDPA by runs, or varlen_attn
    prefill, cached prefix       torch paged                   Triton paged prefill
    vision tower                 SDPA by runs                  SDPA by runs, or varlen_attn
    MoE experts                  per-expert loop               torch._grouped_mm where it
                                                               reads nothing back, else loop

"Fresh" attention (no cached prefix, vision): one SDPA call per run of equal-length
segments (kernels/torch_varlen.py; on CUDA flash first, then efficient, math: never cuDNN,
which compiles a graph per new shape) while a step has at most ``SDPA_MAX_RUNS`` runs; more
runs (many prompts of different lengths, Qwen2.5-VL's windows) go to ``varlen_attn`` in one
launch where it can run them (CUDA, fp16/bf16, head dim <= 256 and a multiple of 8, sm80+;
GQA by ``enable_gqa`` where this torch takes it, else with K/V heads repeated). Every
decision reads host values only: the step's boundaries, dtypes, the device's capability.
"""
from __future__ import annotations

import functools
import logging
import os
from collections.abc import Callable
from typing import Any

import numpy as np
import torch
from triptych.kernels.torch_varlen import (
    Run,
    equal_runs,
    flash_varlen,
    has_sdpa_priority,
    sdpa_runs,
    varlen_api,
)

logger = logging.getLogger("triptych.kernels")

# A step with at most this many runs of equal-length segments runs SDPA once per run
# (flash); more go to varlen_attn in one launch. To be measured on a GPU (the GPU check).
SDPA_MAX_RUNS = 4


@functools.cache
def _capability(index: int) -> tuple[int, int]:
    return torch.cuda.get_device_capability(index)


def _cuda_capability(device: torch.device) -> tuple[int, int]:
    return _capability(device.index if device.index is not None else torch.cuda.current_device())


def flash_usable(q: torch.Tensor, k: torch.Tensor) -> bool:
    """``varlen_attn`` takes these inputs (else SDPA by runs)."""
    api = varlen_api()
    d = q.shape[-1]
    return (api is not None and q.device.type == "cuda"
            and q.dtype in (torch.float16, torch.bfloat16) and k.dtype == q.dtype
            and d % 8 == 0 and d <= 256 and _cuda_capability(q.device) >= (8, 0))


def _host_cu(cu_seqlens: torch.Tensor, cu_seqlens_cpu: Any) -> np.ndarray:
    # NOTE: every caller passes the host copy; without it this reads the device (a sync)
    return np.asarray(cu_seqlens_cpu if cu_seqlens_cpu is not None else cu_seqlens.tolist())


def _fresh(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens: torch.Tensor,
           scale: float, max_seqlen: int | None, cu_cpu: np.ndarray, runs: list[Run],
           causal: bool) -> torch.Tensor:
    if len(runs) > SDPA_MAX_RUNS and flash_usable(q, k):
        longest = max_seqlen if max_seqlen is not None else max(r.length for r in runs)
        return flash_varlen(q, k, v, cu_seqlens, longest, scale, causal)
    return sdpa_runs(q, k, v, runs, scale, causal)


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cu_seqlens: torch.Tensor, scale: float, max_seqlen: int | None = None,
                     cu_seqlens_cpu: Any = None) -> torch.Tensor:
    """Bidirectional attention inside each segment (the vision tower): torch_ref's
    signature. q, k, v: [T, H, D] -> [T, H, D]."""
    cu = _host_cu(cu_seqlens, cu_seqlens_cpu)
    return _fresh(q, k, v, cu_seqlens, scale, max_seqlen, cu, equal_runs(cu), False)


def varlen_causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                            cu_seqlens: torch.Tensor, scale: float,
                            max_seqlen: int | None = None, cu_seqlens_cpu: Any = None,
                            plan: list[Run] | None = None) -> torch.Tensor:
    """Causal attention of each prefill chunk over itself, for a step in which no row has
    a cached prefix: the step's own q [T, H, D] and k/v [T, Hkv, D] (the cache is not
    read; the K/V are written to it for later steps all the same). ``plan``: the runs of
    equal-length chunks (``make_plan``), built once per forward."""
    cu = _host_cu(cu_seqlens, cu_seqlens_cpu)
    runs = plan if plan is not None else equal_runs(cu)
    return _fresh(q, k, v, cu_seqlens, scale, max_seqlen, cu, runs, True)


varlen_causal_attention.make_plan = equal_runs  # type: ignore[attr-defined]


def grouped_mm_for(dtype: torch.dtype, device: torch.device) -> Callable[..., torch.Tensor] | None:
    """``torch._grouped_mm`` where it reads nothing back for these tensors: on the host
    (the interpreter's CPU tensors), and on CUDA for bf16 on sm90/sm100 (its CUTLASS path;
    elsewhere torch loops over ``offs.cpu()``, a device read). None: no such GEMM here."""
    fn = getattr(torch, "_grouped_mm", None)
    if fn is None:
        return None
    if device.type == "cpu":
        return fn
    if device.type == "cuda" and torch.version.hip is None and dtype == torch.bfloat16 \
            and _cuda_capability(device)[0] in (9, 10):
        return fn
    return None


def no_grouped_mm(dtype: torch.dtype, device: torch.device) -> Callable[..., torch.Tensor] | None:
    """The torch and cpu backends keep the per-expert loop (the CPU's production path)."""
    return None


def describe(backend: str, cuda: bool | None = None) -> str:
    """One line naming each phase's kernel for ``backend`` with this torch (``cuda``: the
    triton backend on a GPU; default: not under the Triton interpreter)."""
    if backend in ("torch", "cpu"):
        decode = "C++ paged (kernels/cpu)" if backend == "cpu" else "torch paged SDPA"
        return (f"decode: {decode}; prefill: torch paged SDPA (with or without a cached "
                "prefix); vision: SDPA per run of equal segments; MoE experts: per-expert loop")
    if cuda is None:  # (kernels/triton/common.py's interpreting(), without importing triton)
        cuda = os.environ.get("TRITON_INTERPRET") != "1"
    api = varlen_api()
    order = ("flash > efficient > math, no cuDNN" if has_sdpa_priority() else
             "torch's order") if cuda else "CPU"
    fresh = f"SDPA per run of equal lengths ({order})"
    if cuda and api is not None:
        gqa = "GQA" if api.gqa else "GQA by repeated K/V heads (this torch has no enable_gqa)"
        fresh += (f", varlen_attn above {SDPA_MAX_RUNS} runs (fp16/bf16, head dim <= 256 "
                  f"and %8, sm80+, {gqa})")
    elif cuda:
        fresh += ", varlen_attn absent from this torch"
    gmm = "torch._grouped_mm" if getattr(torch, "_grouped_mm", None) is not None else None
    moe = (f"{gmm} (bf16 on sm90/sm100{'; the host' if not cuda else ''}), else the "
           "per-expert loop (one device read a layer: decode not captured)"
           if gmm else "per-expert loop (no torch._grouped_mm here)")
    return (f"decode: Triton paged; prefill without a cached prefix: {fresh}, fresh q/k/v; "
            f"prefill with a cached prefix: Triton paged; vision: {fresh}; MoE experts: {moe}")


@functools.cache
def log_once(backend: str) -> None:
    """Log ``describe(backend)`` the first time a process builds that backend's ops."""
    logger.info("attention and MoE kernels per phase (%s backend, torch %s): %s", backend,
                torch.__version__, describe(backend))
