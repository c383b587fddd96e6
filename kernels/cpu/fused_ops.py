"""The CPU decoder layer's small ops fused in C++ (``csrc/cpu_fused_ops/``): residual
add + RMSNorm, M-RoPE of q and k, the K/V cache write and the MLP's silu(gate) * up, one
op each where the torch reference issues 2-10 (the ``cpu`` backend's ``rms_norm`` /
``apply_mrope`` / ``reshape_and_cache`` / ``silu_and_mul``; ``kernels.get_ops``). Same
signatures as ``torch_ref``; anything the C++ ops do not take (non-fp32 activations, a
3-D norm input, a cache dtype other than the key's, columns that are not unit-stride)
goes to ``torch_ref``. ``TRIPTYCH_CPU_FUSED_OPS=0`` (env, read when the
ops are chosen) keeps the torch reference: an A/B switch for benchmarks.

Results: M-RoPE and the cache write equal the reference bit for bit; the norm differs by
the rounding of its mean (another summation order); silu_and_mul by its exp's rounding
(a few ulp: tests/test_cpu_fused_ops.py states the bound). Measured in
docs/performance.md, "Batch 1: the layers' small ops" and "Batch 32 and the layers' small
ops".
"""
from __future__ import annotations

import functools
import logging
import os

import torch
from triptych.kernels import torch_ref
from triptych.kernels.cpu import build as cpu_build
from triptych.kernels.cpu import isa

logger = logging.getLogger("triptych.cpu_fused_ops")

LIBRARY = "cpu_fused_ops"
def enabled() -> bool:
    """``TRIPTYCH_CPU_FUSED_OPS`` is not 0 and the library is built and loaded here."""
    if os.environ.get("TRIPTYCH_CPU_FUSED_OPS", "1") == "0":
        return False
    return cpu_build.usable(LIBRARY, logger,
                            "the fused CPU layer ops are unavailable, using the torch ones")


@functools.cache
def _built() -> tuple[int, ...]:
    return tuple(torch.ops.triptych_fused.variants())


def variant_id() -> int:
    """The variant this process runs (the platform's choice, as far as this build holds it)."""
    return isa.variant_id(LIBRARY, _built())


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """torch_ref.rms_norm in one pass: with ``residual``, (norm(x + residual), x + residual)."""
    if x.dim() != 2 or x.dtype != torch.float32 or weight.dtype != torch.float32 or \
            x.device.type != "cpu" or x.stride(-1) != 1 or (residual is not None and (
                residual.dtype != torch.float32 or residual.stride(-1) != 1)):
        return torch_ref.rms_norm(x, weight, eps, residual)
    y, total = torch.ops.triptych_fused.add_rms_norm(x, residual, weight.contiguous(), eps,
                                                     variant_id())
    return y if residual is None else (y, total)


def apply_mrope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                cos_sin_cache: torch.Tensor, mrope_section: list[int],
                plan: tuple[torch.Tensor, torch.Tensor] | None = None
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """torch_ref.apply_mrope for q and k in one op (fp32; others: the reference)."""
    if q.dtype != torch.float32 or k.dtype != torch.float32 or q.device.type != "cpu" or \
            q.stride(-1) != 1 or k.stride(-1) != 1:
        return torch_ref.apply_mrope(q, k, positions, cos_sin_cache, mrope_section, plan)
    cos, sin = plan if plan is not None else torch_ref.mrope_plan(
        positions, cos_sin_cache, mrope_section)
    return torch.ops.triptych_fused.mrope(q, k, cos.contiguous(), sin.contiguous(), variant_id())


apply_mrope.make_plan = torch_ref.mrope_plan  # type: ignore[attr-defined]


def reshape_and_cache(key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                      v_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """torch_ref.reshape_and_cache in one op (slot -1 skipped), in place."""
    if key.dtype != k_cache.dtype or value.dtype != v_cache.dtype or \
            slot_mapping.dtype != torch.int64 or key.device.type != "cpu" or \
            k_cache.device.type != "cpu" or not k_cache.is_contiguous() or \
            not v_cache.is_contiguous():
        return torch_ref.reshape_and_cache(key, value, k_cache, v_cache, slot_mapping)
    key = key if key.stride(1) == key.shape[2] and key.stride(2) == 1 else key.contiguous()
    value = value if value.stride(1) == value.shape[2] and value.stride(2) == 1 \
        else value.contiguous()
    torch.ops.triptych_fused.cache_write(key, value, k_cache, v_cache,
                                         slot_mapping.contiguous())
    return None


def silu_and_mul(gate_up: torch.Tensor, inter: int) -> torch.Tensor:
    """torch_ref.silu_and_mul in one pass over the fused gate|up output (fp32 [T, 2I] with
    unit-stride columns; rows may be strided; others: the reference)."""
    if gate_up.dim() != 2 or gate_up.dtype != torch.float32 or \
            gate_up.device.type != "cpu" or gate_up.stride(-1) != 1 or \
            gate_up.shape[1] != 2 * inter:  # the reference says what is wrong
        return torch_ref.silu_and_mul(gate_up, inter)
    return torch.ops.triptych_fused.silu_and_mul(gate_up, inter, variant_id())
