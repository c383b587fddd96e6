"""Triton RMSNorm (optionally fused with the residual add) and M-RoPE application."""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, eps, N: tl.constexpr,
                     BLOCK: tl.constexpr, HAS_RES: tl.constexpr):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    m = offs < N
    x = tl.load(x_ptr + row * N + offs, mask=m, other=0.0).to(tl.float32)
    if HAS_RES:
        x += tl.load(res_ptr + row * N + offs, mask=m, other=0.0).to(tl.float32)
        tl.store(res_out_ptr + row * N + offs, x.to(res_out_ptr.dtype.element_ty), mask=m)
    # Round the sum like the reference: the residual stream is kept in the input dtype.
    x = x.to(out_ptr.dtype.element_ty).to(tl.float32)
    var = tl.sum(x * x, axis=0) / N
    w = tl.load(w_ptr + offs, mask=m, other=0.0).to(tl.float32)
    y = x * tl.rsqrt(var + eps)
    tl.store(out_ptr + row * N + offs, (w * y).to(out_ptr.dtype.element_ty), mask=m)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float,
             residual: torch.Tensor | None = None
             ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """x: [T, N]; same contract as ``torch_ref.rms_norm`` (fp32 math)."""
    assert x.dim() == 2 and weight.shape == (x.shape[1],) and x.device == weight.device
    x = x.contiguous()
    t, n = x.shape
    out = torch.empty_like(x)
    res_out = torch.empty_like(x) if residual is not None else out
    res = residual.contiguous() if residual is not None else x
    if t:
        _rms_norm_kernel[(t,)](x, res, weight, out, res_out, eps, N=n,
                               BLOCK=triton.next_power_of_2(n), HAS_RES=residual is not None)
    return out if residual is None else (out, res_out)


@triton.jit
def _mrope_kernel(x_ptr, pos_ptr, cache_ptr, T, stride_t, stride_h, NH: tl.constexpr,
                  HALF: tl.constexpr, HALF_PAD: tl.constexpr, NH_PAD: tl.constexpr,
                  S0: tl.constexpr, S1: tl.constexpr):
    # One program per token: rotates all NH heads of x in place (neox: rotate halves).
    t = tl.program_id(0)
    j = tl.arange(0, HALF_PAD)
    hs = tl.arange(0, NH_PAD)
    mj = j < HALF
    sec = (j >= S0).to(tl.int32) + (j >= S0 + S1).to(tl.int32)  # 0 = t, 1 = h, 2 = w
    pos = tl.load(pos_ptr + sec * T + t, mask=mj, other=0)
    cos = tl.load(cache_ptr + pos * (2 * HALF) + j, mask=mj, other=1.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * (2 * HALF) + HALF + j, mask=mj, other=0.0).to(tl.float32)
    mask = (hs[:, None] < NH) & mj[None, :]
    base = x_ptr + t * stride_t + hs[:, None] * stride_h + j[None, :]
    x1 = tl.load(base, mask=mask, other=0.0).to(tl.float32)
    x2 = tl.load(base + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(base, (x1 * cos[None, :] - x2 * sin[None, :]).to(x_ptr.dtype.element_ty), mask=mask)
    tl.store(base + HALF, (x2 * cos[None, :] + x1 * sin[None, :]).to(x_ptr.dtype.element_ty),
             mask=mask)


def apply_mrope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                cos_sin_cache: torch.Tensor, mrope_section: list[int]
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Same contract as ``torch_ref.apply_mrope``; returns rotated copies of q and k."""
    t, _, d = q.shape
    assert positions.shape == (3, t) and cos_sin_cache.shape[1] == d
    assert sum(mrope_section) == d // 2 and q.device == positions.device
    pos = positions.contiguous()
    cache = cos_sin_cache.contiguous()
    outs = []
    for x in (q, k):
        x = x.contiguous().clone()
        if t:
            _mrope_kernel[(t,)](x, pos, cache, t, x.stride(0), x.stride(1), NH=x.shape[1],
                                HALF=d // 2, HALF_PAD=triton.next_power_of_2(d // 2),
                                NH_PAD=triton.next_power_of_2(x.shape[1]),
                                S0=mrope_section[0], S1=mrope_section[1])
        outs.append(x)
    return outs[0], outs[1]
