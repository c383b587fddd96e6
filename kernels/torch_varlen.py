"""Varlen attention over a step's fresh q/k/v with torch's own kernels (no paged cache):
the language model's prefill chunks without a cached prefix (causal) and the vision
tower's segments (bidirectional). ``kernels/choice.py`` decides which of the two runs.

    sdpa_runs     one SDPA call per run of consecutive segments of equal length, each a
                  view of q/k/v (no gather, no padding); GQA through ``enable_gqa`` (K/V
                  never repeated); on CUDA inside ``sdpa_kernel`` with flash first, then
                  efficient, math (SDPA takes the first that accepts the inputs)
    flash_varlen  ``torch.nn.attention.varlen.varlen_attn``: the whole batch in one launch
                  (torch's FlashAttention-2 varlen), CUDA fp16/bf16; GQA by its
                  ``enable_gqa`` where this torch has it, else K/V heads repeated first

NOTE: cuDNN's SDPA is not in the serving path. It builds a graph per new sequence-length
shape (~0.4 s each, measured by SGLang; torch's ``TORCH_CUDNN_SDPA_AVOID_RECOMPILE`` is
opt-in), so every new prompt length or image size would stall the step that meets it;
flash and efficient compile nothing at run time. (On an H200 cuDNN was the fastest once
compiled: the GPU check's attn step measures both, first calls included.)

    cu (host):    0      5            12   15   18
    segments:     [  5  ][     7      ][ 3 ][ 3 ]      runs: (5) (7) (3, 3)

Both read the boundaries from the host (no device read) and run head dims 64/72/80/128 as
they are: padding a head to a power of two is only the Triton kernels' constraint.
"""
from __future__ import annotations

import contextlib
import functools
import inspect
from collections.abc import Callable, Iterator
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.nn.functional as F


class VarlenApi(NamedTuple):
    """How this torch spells ``varlen_attn`` (its signature changed across versions)."""

    fn: Callable[..., torch.Tensor]
    causal: dict[str, Any]  # the keyword that makes it causal: window_size or is_causal
    gqa: bool  # it takes ``enable_gqa`` (fewer K/V heads than query heads)


@functools.cache
def varlen_api() -> VarlenApi | None:
    """``varlen_attn`` of this torch, or None when absent or spelled in a way not known here.

    torch 2.11: ``(q, k, v, cu_seq_q, cu_seq_k, max_q, max_k, *, scale, window_size)``,
    causal = ``window_size=(-1, 0)``; torch 2.13 adds ``enable_gqa``; earlier releases took
    ``is_causal``."""
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError:
        return None
    params = inspect.signature(varlen_attn).parameters
    positional = [p for p in params.values()
                  if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) < 7 or "scale" not in params:
        return None
    if "window_size" in params:
        causal: dict[str, Any] = {"window_size": (-1, 0)}
    elif "is_causal" in params:
        causal = {"is_causal": True}
    else:
        return None
    return VarlenApi(varlen_attn, causal, "enable_gqa" in params)


def flash_varlen(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 cu_seqlens: torch.Tensor, max_len: int, scale: float, causal: bool
                 ) -> torch.Tensor:
    """q: [T, H, D], k/v: [T, Hkv, D] -> [T, H, D] through ``varlen_attn`` (the caller has
    checked ``choice.flash_usable``). cu_seqlens: [N+1] on the device; max_len: host int."""
    api = varlen_api()
    assert api is not None, "flash_varlen without varlen_attn (choice.flash_usable first)"
    kw: dict[str, Any] = dict(api.causal) if causal else {}
    if q.shape[1] != k.shape[1]:
        if api.gqa:
            kw["enable_gqa"] = True
        else:  # (torch 2.11) K/V repeated to the query heads: one launch all the same
            g = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(g, dim=1), v.repeat_interleave(g, dim=1)
    cu = cu_seqlens if cu_seqlens.dtype == torch.int32 else cu_seqlens.to(torch.int32)
    return api.fn(q, k, v, cu, cu, max_len, max_len, scale=scale, **kw)


class Run(NamedTuple):
    """Consecutive segments of one length: rows ``start:end`` hold ``n`` segments."""

    start: int
    end: int
    n: int
    length: int


def equal_runs(cu: np.ndarray) -> list[Run]:
    """The runs of consecutive equal-length segments of ``cu`` (empty segments dropped)."""
    cu = np.asarray(cu, dtype=np.int64)
    lens = np.diff(cu)
    if not len(lens):
        return []
    cut = np.flatnonzero(np.diff(lens)) + 1
    firsts = np.concatenate(([0], cut)).tolist()
    lasts = np.concatenate((cut, [len(lens)])).tolist()
    return [Run(int(cu[a]), int(cu[b]), b - a, int(lens[a]))
            for a, b in zip(firsts, lasts) if lens[a] > 0]


def _backend(name: str) -> Any:
    from torch.nn.attention import SDPBackend

    return getattr(SDPBackend, name)


try:  # the SDPA backends the serving path allows, in order (module NOTE: no cuDNN)
    SERVING_ORDER = [_backend(n) for n in ("FLASH_ATTENTION", "EFFICIENT_ATTENTION", "MATH")]
except ImportError:
    SERVING_ORDER = []


@functools.cache
def _cuda_priority() -> Callable[[], contextlib.AbstractContextManager] | None:
    """Flash, then efficient, math, as ``sdpa_kernel``'s priority and the only backends
    allowed (no cuDNN: it compiles per new shape, module NOTE); None where this torch
    cannot order them."""
    try:
        from torch.nn.attention import sdpa_kernel
    except ImportError:
        return None
    order = SERVING_ORDER
    if "set_priority" not in inspect.signature(sdpa_kernel).parameters:
        return lambda: sdpa_kernel(order)  # (these backends only, in torch's own order)
    return lambda: sdpa_kernel(order, set_priority=True)


def has_sdpa_priority() -> bool:
    return _cuda_priority() is not None


@contextlib.contextmanager
def _backends(device: torch.device) -> Iterator[None]:
    make = _cuda_priority() if device.type == "cuda" else None
    with make() if make is not None else contextlib.nullcontext():
        yield


def sdpa_runs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, runs: list[Run],
              scale: float, causal: bool) -> torch.Tensor:
    """q: [T, H, D], k/v: [T, Hkv, D] -> [T, H, D]: one SDPA call per run.

    NOTE: rows outside every segment (none in a real batch) are left unwritten."""
    t, h, d = q.shape
    hkv = k.shape[1]
    kw: dict[str, Any] = {"scale": scale, "is_causal": causal}
    if h != hkv:
        kw["enable_gqa"] = True
    with _backends(q.device):
        if len(runs) == 1 and runs[0].start == 0 and runs[0].end == t:
            r = runs[0]  # the common case (one prompt, one image): no output copy
            qs = q.view(r.n, r.length, h, d).transpose(1, 2)
            ks, vs = (x.view(r.n, r.length, hkv, d).transpose(1, 2) for x in (k, v))
            o = F.scaled_dot_product_attention(qs, ks, vs, **kw)  # [n, H, len, D]
            return o.transpose(1, 2).reshape(t, h, d)
        out = q.new_empty(t, h, d)
        for r in runs:
            qs = q[r.start:r.end].view(r.n, r.length, h, d).transpose(1, 2)
            ks, vs = (x[r.start:r.end].view(r.n, r.length, hkv, d).transpose(1, 2)
                      for x in (k, v))
            o = F.scaled_dot_product_attention(qs, ks, vs, **kw)
            out[r.start:r.end] = o.transpose(1, 2).reshape(r.end - r.start, h, d)
    return out
