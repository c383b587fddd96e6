"""Triton RMSNorm (optionally fused with the residual add) and M-RoPE application.

Both upcast every load to fp32 (the math is fp32 for all input dtypes, and the interpreter
under TRITON_INTERPRET=1 computes bf16 wrongly otherwise) and store in the input dtype.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from triptych.kernels.triton.common import check_tensors, require


@triton.jit
def _rms_norm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, eps, N: tl.constexpr,
                     BLOCK: tl.constexpr, HAS_RES: tl.constexpr):
    # One program per row of N features.
    row = tl.program_id(0).to(tl.int64)
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
    """RMSNorm over the last dim in fp32; with ``residual``, returns
    (norm(x + residual), x + residual). x, residual: [..., N]; weight: [N]."""
    fn = "rms_norm"
    floats = {"x": x, "weight": weight}
    if residual is not None:
        floats["residual"] = residual
    check_tensors(fn, floats)
    require(x.dim() >= 1 and weight.shape == (x.shape[-1],),
            lambda: f"{fn}: weight {tuple(weight.shape)} does not match x {tuple(x.shape)}")
    require(residual is None or (residual.shape == x.shape and residual.dtype == x.dtype),
            lambda: f"{fn}: residual must match x in shape and dtype")
    n = x.shape[-1]
    x2 = x.reshape(-1, n).contiguous()  # [T, N]
    out = torch.empty_like(x2)
    res_out = torch.empty_like(x2) if residual is not None else out
    res = residual.reshape(-1, n).contiguous() if residual is not None else x2
    block = triton.next_power_of_2(n)
    if x2.shape[0]:
        _rms_norm_kernel[(x2.shape[0],)](x2, res, weight, out, res_out, eps, N=n, BLOCK=block,
                                         HAS_RES=residual is not None,
                                         num_warps=8 if block >= 2048 else 4)
    out = out.view(x.shape)
    return out if residual is None else (out, res_out.view(x.shape))


@triton.jit(do_not_specialize=["T"])  # (tokens per step: one compile for every T)
def _mrope_kernel(x_ptr, o_ptr, pos_ptr, cache_ptr, T, stride_t, stride_h, NH: tl.constexpr,
                  HALF: tl.constexpr, HALF_PAD: tl.constexpr, NH_PAD: tl.constexpr,
                  S0: tl.constexpr, S1: tl.constexpr):
    # One program per token: rotates all NH heads of x into o ([T, NH, 2*HALF] contiguous).
    t = tl.program_id(0)
    j = tl.arange(0, HALF_PAD)
    hs = tl.arange(0, NH_PAD)
    mj = j < HALF
    # Frequency j reads the position of its section:  | t: j < S0 | h: < S0+S1 | w: rest |
    sec = (j >= S0).to(tl.int32) + (j >= S0 + S1).to(tl.int32)
    pos = tl.load(pos_ptr + sec * T + t, mask=mj, other=0).to(tl.int64)
    cos = tl.load(cache_ptr + pos * (2 * HALF) + j, mask=mj, other=1.0).to(tl.float32)
    sin = tl.load(cache_ptr + pos * (2 * HALF) + HALF + j, mask=mj, other=0.0).to(tl.float32)
    mask = (hs[:, None] < NH) & mj[None, :]
    src = x_ptr + t.to(tl.int64) * stride_t + hs[:, None] * stride_h + j[None, :]
    dst = o_ptr + t.to(tl.int64) * (NH * 2 * HALF) + hs[:, None] * (2 * HALF) + j[None, :]
    x1 = tl.load(src, mask=mask, other=0.0).to(tl.float32)  # [NH_PAD, HALF_PAD]
    x2 = tl.load(src + HALF, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst, (x1 * cos[None, :] - x2 * sin[None, :]).to(o_ptr.dtype.element_ty), mask=mask)
    tl.store(dst + HALF, (x2 * cos[None, :] + x1 * sin[None, :]).to(o_ptr.dtype.element_ty),
             mask=mask)


def apply_mrope(q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor,
                cos_sin_cache: torch.Tensor, mrope_section: list[int]
                ) -> tuple[torch.Tensor, torch.Tensor]:
    """Multimodal rotary embedding (Qwen2-VL), neox style; same contract as
    ``torch_ref.apply_mrope``. q: [T, H, D]; k: [T, Hkv, D]; positions: [3, T] int;
    cos_sin_cache: [max_pos, D] (cos | sin); mrope_section: 3 ints summing to D/2.
    Returns rotated copies of q and k (contiguous, input dtypes)."""
    fn = "apply_mrope"
    check_tensors(fn, {"q": q, "k": k, "cos_sin_cache": cos_sin_cache},
                  {"positions": positions})
    require(q.dim() == 3 and k.dim() == 3 and k.shape[0] == q.shape[0]
            and k.shape[2] == q.shape[2], lambda: f"{fn}: q {tuple(q.shape)} / k {tuple(k.shape)}")
    t, _, d = q.shape
    require(positions.shape == (3, t), lambda: f"{fn}: positions must be [3, {t}]")
    require(cos_sin_cache.dim() == 2 and cos_sin_cache.shape[1] == d,
            lambda: f"{fn}: cos_sin_cache must be [max_pos, {d}]")
    require(len(mrope_section) == 3 and sum(mrope_section) == d // 2,
            lambda: f"{fn}: mrope_section {mrope_section} must be 3 ints summing to {d // 2}")
    pos = positions.contiguous()
    cache = cos_sin_cache.contiguous()
    outs = []
    for x in (q, k):
        o = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        if t:
            _mrope_kernel[(t,)](x, o, pos, cache, t, x.stride(0), x.stride(1), NH=x.shape[1],
                                HALF=d // 2, HALF_PAD=triton.next_power_of_2(d // 2),
                                NH_PAD=triton.next_power_of_2(x.shape[1]),
                                S0=mrope_section[0], S1=mrope_section[1])
        outs.append(o)
    return outs[0], outs[1]
