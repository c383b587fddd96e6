"""Attention and normalisation kernels: Triton on CUDA, plain torch on CPU.

``get_ops(backend)`` returns a namespace with the same functions for either backend:
reshape_and_cache, paged_decode_attention, paged_prefill_attention, varlen_attention,
rms_norm, apply_mrope (signatures in ``torch_ref``).
"""
from __future__ import annotations

import os
from types import SimpleNamespace

from triptych.kernels import torch_ref

BACKENDS = ("torch", "triton")


def resolve_backend(backend: str | None, device: str) -> str:
    """Pick the attention backend: triton on CUDA, torch on CPU, unless told otherwise."""
    if backend in (None, "", "auto"):
        return "triton" if device.startswith("cuda") else "torch"
    if backend not in BACKENDS:
        raise ValueError(f"unknown attention backend {backend!r}; choose one of {BACKENDS}")
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
    if backend == "torch":
        mod = torch_ref
    elif backend == "triton":
        from triptych.kernels import triton_ops as mod  # noqa: PLC0415
    else:
        raise ValueError(f"unknown attention backend {backend!r}")
    return SimpleNamespace(
        reshape_and_cache=mod.reshape_and_cache,
        paged_decode_attention=mod.paged_decode_attention,
        paged_prefill_attention=mod.paged_prefill_attention,
        varlen_attention=mod.varlen_attention,
        rms_norm=mod.rms_norm,
        apply_mrope=mod.apply_mrope,
    )


__all__ = ["BACKENDS", "get_ops", "resolve_backend", "torch_ref"]
