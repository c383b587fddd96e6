"""Attention and normalisation kernels: Triton on CUDA; on CPU plain torch, with the
decode attention fused in C++ (``cpu``, the CPU default, built on first use).

``get_ops(backend)`` returns a namespace with the same functions for every backend:
reshape_and_cache, paged_decode_attention, paged_prefill_attention, varlen_attention,
rms_norm, apply_mrope, silu_and_mul (signatures in ``torch_ref``), plus
varlen_causal_attention (prefill without a cached prefix on the step's fresh q/k/v; None:
the paged prefill serves it) and grouped_mm_for (the MoE experts' sync-free grouped GEMM,
or None). ``cpu`` is ``torch`` with ``paged_decode_attention`` from
``cpu_paged_attention`` and, when it builds, ``rms_norm``, ``apply_mrope``,
``reshape_and_cache`` and ``silu_and_mul`` from ``cpu_fused_ops``. Which kernel each phase
runs is ``choice``'s decision, logged once per process.
"""
from __future__ import annotations

import os
from types import SimpleNamespace

from triptych.kernels import choice, torch_ref

BACKENDS = ("torch", "cpu", "triton")


def _cpu_kernels() -> bool:
    from triptych.kernels.cpu import paged_attention as cpu_paged_attention  # noqa: PLC0415 (builds on first use)

    return cpu_paged_attention.available()


def resolve_backend(backend: str | None, device: str) -> str:
    """Pick the attention backend: triton on CUDA; on CPU the fused C++ decode (cpu) when
    it builds here, else torch (a warning says why). Explicit choices are checked."""
    if backend in (None, "", "auto"):
        if device.startswith("cuda"):
            return "triton"
        return "cpu" if _cpu_kernels() else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")
    if backend == "cpu":
        if device.startswith("cuda"):
            raise ValueError("attention_backend='cpu' runs on the CPU; use triton on CUDA")
        if not _cpu_kernels():
            raise ValueError("attention_backend='cpu' needs its C++ kernel, which did not "
                             "build here (see the warning above); use attention_backend='torch'")
    if backend == "triton" and not device.startswith("cuda"):
        if os.environ.get("TRITON_INTERPRET") != "1":
            raise ValueError(
                "attention_backend='triton' on CPU needs the Triton interpreter: set "
                "TRITON_INTERPRET=1 in the environment before starting (it is ~1000x slower "
                "than the torch backend and meant for testing), or use attention_backend='torch'"
            )
    return backend


def get_ops(backend: str) -> SimpleNamespace:
    """The kernel functions of one backend (imported lazily: triton is optional)."""
    if backend in ("torch", "cpu"):
        mod = torch_ref
    elif backend == "triton":
        from triptych.kernels.triton import ops as mod  # noqa: PLC0415
    else:
        raise ValueError(f"unknown attention backend {backend!r}")
    decode = mod.paged_decode_attention
    if backend == "cpu":
        if not _cpu_kernels():
            raise ValueError("attention backend 'cpu': its C++ kernel did not build here; "
                             "use attention_backend='torch'")
        from triptych.kernels.cpu import paged_attention as cpu_paged_attention  # noqa: PLC0415

        decode = cpu_paged_attention.paged_decode_attention
        from triptych.kernels.cpu import fused_ops as cpu_fused_ops  # noqa: PLC0415 (builds on first use)

        if cpu_fused_ops.enabled():  # residual + norm, M-RoPE, cache write, SwiGLU: one op each
            mod = cpu_fused_ops
    choice.log_once(backend)
    fresh = backend == "triton"  # the torch / cpu backends keep the CPU's kernels as they are
    return SimpleNamespace(
        reshape_and_cache=mod.reshape_and_cache,
        paged_decode_attention=decode,
        paged_prefill_attention=torch_ref.paged_prefill_attention if backend == "cpu"
        else mod.paged_prefill_attention,
        varlen_causal_attention=choice.varlen_causal_attention if fresh else None,
        varlen_attention=choice.varlen_attention if fresh else torch_ref.varlen_attention,
        rms_norm=mod.rms_norm,
        apply_mrope=mod.apply_mrope,
        silu_and_mul=mod.silu_and_mul,
        grouped_mm_for=choice.grouped_mm_for if fresh else choice.no_grouped_mm,
    )


__all__ = ["BACKENDS", "get_ops", "resolve_backend", "torch_ref"]
