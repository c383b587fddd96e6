"""What the Triton kernels share: the online-softmax tile step, the fp32-upcast rule, and
the argument checks every wrapper runs before a launch.

NOTE (interpreter): under ``TRITON_INTERPRET=1`` Triton computes bf16 arithmetic wrongly,
so every kernel upcasts its loads to fp32 there (``upcast``); on a GPU fp16/bf16 operands
of ``tl.dot`` go to the tensor cores as they are and accumulate in fp32.
"""
from __future__ import annotations

import functools
import os
from collections.abc import Callable

import torch
import triton
import triton.language as tl

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
INDEX_DTYPES = (torch.int32, torch.int64)


def interpreting() -> bool:
    """True when Triton runs kernels as Python (CPU tests), read at call time."""
    return os.environ.get("TRITON_INTERPRET") == "1"


def upcast(x: torch.Tensor) -> bool:
    """fp32 math (IEEE dots, no TF32) for fp32 inputs and under the interpreter."""
    return x.dtype == torch.float32 or interpreting()


@functools.cache
def num_sms(device: torch.device) -> int:
    """Streaming multiprocessors of a CUDA device (a nominal 8 on CPU/interpreter)."""
    if device.type != "cuda":
        return 8
    return torch.cuda.get_device_properties(device).multi_processor_count


def require(cond: bool, msg: str | Callable[[], str]) -> None:
    """Wrapper checks raise (not assert: they must survive ``python -O``). ``msg``: a
    string, or a function that builds it: an f-string of shapes costs microseconds, paid
    on every launch when it is an argument (~2 ms of host time per eager decode step at 28
    layers, docs/performance.md), and only on failure when it is a lambda."""
    if not cond:
        raise ValueError(msg() if callable(msg) else msg)


def check_tensors(fn: str, floats: dict[str, torch.Tensor],
                  ints: dict[str, torch.Tensor] | None = None) -> None:
    """Same device for all; float tensors fp16/bf16/fp32 with a unit last stride; index
    tensors int32/int64. The device must be CUDA, or CPU under the interpreter.

    NOTE: one pass of plain comparisons; the message is built only when one fails."""
    dev = next(iter(floats.values())).device
    ok = dev.type == "cuda" or interpreting()
    for t in floats.values():
        ok = ok and t.device == dev and t.dtype in FLOAT_DTYPES and (
            t.dim() == 0 or t.stride(-1) == 1 or t.numel() == 0)
    for t in (ints or {}).values():
        ok = ok and t.device == dev and t.dtype in INDEX_DTYPES
    if not ok:
        _explain(fn, dev, floats, ints or {})


def _explain(fn: str, dev: torch.device, floats: dict[str, torch.Tensor],
             ints: dict[str, torch.Tensor]) -> None:
    """Raise the first failing check of ``check_tensors`` by name."""
    for name, t in {**floats, **ints}.items():
        require(t.device == dev, f"{fn}: {name} is on {t.device}, expected {dev}")
    for name, t in floats.items():
        require(t.dtype in FLOAT_DTYPES, f"{fn}: {name} has dtype {t.dtype}; "
                f"expected one of {FLOAT_DTYPES}")
        require(t.dim() == 0 or t.numel() == 0 or t.stride(-1) == 1,
                f"{fn}: {name} must have a contiguous last dimension")
    for name, t in ints.items():
        require(t.dtype in INDEX_DTYPES, f"{fn}: {name} has dtype {t.dtype}; expected int32/int64")
    require(False, f"{fn}: Triton kernels need CUDA tensors, or TRITON_INTERPRET=1 for CPU "
                   "tensors")


def check_cache(fn: str, k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    """Paged KV layout: [num_blocks, block_size, Hkv, D] each, same shape, contiguous."""
    require(k_cache.dim() == 4, lambda: f"{fn}: k_cache must be [num_blocks, block_size, Hkv, D], "
            f"got {tuple(k_cache.shape)}")
    require(v_cache.shape == k_cache.shape and v_cache.dtype == k_cache.dtype,
            lambda: f"{fn}: v_cache {tuple(v_cache.shape)}/{v_cache.dtype} differs from k_cache "
            f"{tuple(k_cache.shape)}/{k_cache.dtype}")
    require(k_cache.is_contiguous() and v_cache.is_contiguous(),
            lambda: f"{fn}: k_cache/v_cache must be contiguous")


def pad_dim(d: int) -> int:
    """Head dim padded to a power of two that ``tl.dot`` accepts (>= 16)."""
    return max(triton.next_power_of_2(d), 16)


@triton.jit
def attend_tile(q, k, v, keep, m_i, l_i, acc, scale, UPCAST: tl.constexpr):
    """One online-softmax step: fold a [BLOCK_N] key tile into (m, l, acc) of [BLOCK_M]
    query rows; ``keep`` [BLOCK_M, BLOCK_N] masks the pairs that may attend.

    NOTE: callers guarantee every row keeps at least one key of its first tile, so m_i is
    finite after it and a later fully masked tile gives alpha = 1, p = 0 (never NaN).
    """
    if UPCAST:
        k, v = k.to(tl.float32), v.to(tl.float32)
        s = tl.dot(q, tl.trans(k), input_precision="ieee")
    else:
        s = tl.dot(q, tl.trans(k))
    s = tl.where(keep, s * scale, float("-inf"))  # [BLOCK_M, BLOCK_N]
    m_new = tl.maximum(m_i, tl.max(s, axis=1))
    alpha = tl.exp(m_i - m_new)
    p = tl.exp(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, axis=1)
    if UPCAST:
        pv = tl.dot(p, v, input_precision="ieee")
    else:
        pv = tl.dot(p.to(v.dtype), v)
    return m_new, l_i, acc * alpha[:, None] + pv
