"""Triton paged prefill attention and varlen vision attention (flash-attention style).

Prefill: a flattened batch of query chunks (cu_seqlens_q), each attending causally to its
cached prefix and to itself through the block table. Query i of a chunk of length q_len
in a sequence of seq_len tokens sits at position ``seq_len - q_len + i``:

    keys:    0 .................... prefix ......... | chunk (new) |
    query i:                                    sees keys <= seq_len - q_len + i

Grid (B, H, cdiv(max_q_len, BLOCK_M)); keys are visited in tiles of BLOCK_N tokens, each
token's cache row found through the block table, so BLOCK_N is independent of block_size.
Vision attention is the same loop without the cache and without the causal mask.
fp32 inputs (and every input under the interpreter) are computed in fp32 with IEEE dots
(no TF32); fp16/bf16 on a GPU feed the tensor cores directly and accumulate in fp32.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl


@triton.jit
def _attend_tile(q, k, v, keep, m_i, l_i, acc, scale, UPCAST: tl.constexpr):
    """One online-softmax step: fold a [BLOCK_N] key tile into (m, l, acc) of [BLOCK_M]
    queries; ``keep`` masks the (query, key) pairs that may attend."""
    # IEEE fp32 dots when upcasting (no TF32); fp16/bf16 operands go to the tensor cores.
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


@triton.jit
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, bt_ptr, cu_q_ptr, seq_lens_ptr,
                    scale, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_btb,
                    stride_ot, stride_oh, G: tl.constexpr, D: tl.constexpr,
                    D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, UPCAST: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    mt = tl.program_id(2)
    q_start = tl.load(cu_q_ptr + b)
    q_len = tl.load(cu_q_ptr + b + 1) - q_start
    if mt * BLOCK_M >= q_len:
        return
    seq_len = tl.load(seq_lens_ptr + b)
    prefix = seq_len - q_len
    kvh = h // G
    offs_m = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    mask_m = offs_m < q_len
    mask_d = offs_d < D
    q = tl.load(q_ptr + (q_start + offs_m)[:, None] * stride_qt + h * stride_qh + offs_d[None, :],
                mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    q_pos = prefix + offs_m
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    kv_end = tl.minimum(prefix + (mt + 1) * BLOCK_M, seq_len)  # causal: nothing beyond
    for n0 in range(0, kv_end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < kv_end
        blk = tl.load(bt_ptr + b * stride_btb + offs_n // BLOCK_SIZE, mask=mask_n, other=0)
        row = blk.to(tl.int64) * stride_kb + (offs_n % BLOCK_SIZE) * stride_ks + kvh * stride_kh
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_cache_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        keep = (offs_n[None, :] <= q_pos[:, None]) & mask_n[None, :]  # causal
        m_i, l_i, acc = _attend_tile(q, k, v, keep, m_i, l_i, acc, scale, UPCAST)
    out = acc / l_i[:, None]
    tl.store(out_ptr + (q_start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


@triton.jit
def _varlen_kernel(q_ptr, k_ptr, v_ptr, out_ptr, cu_ptr, scale, stride_t, stride_h,
                   stride_ot, stride_oh, D: tl.constexpr, D_PAD: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr):
    seg = tl.program_id(0)
    h = tl.program_id(1)
    mt = tl.program_id(2)
    start = tl.load(cu_ptr + seg)
    n = tl.load(cu_ptr + seg + 1) - start
    if mt * BLOCK_M >= n:
        return
    offs_m = mt * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D_PAD)
    mask_m = offs_m < n
    mask_d = offs_d < D
    q = tl.load(q_ptr + (start + offs_m)[:, None] * stride_t + h * stride_h + offs_d[None, :],
                mask=mask_m[:, None] & mask_d[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D_PAD], tl.float32)
    for n0 in range(0, n, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < n
        ptr = (start + offs_n)[:, None] * stride_t + h * stride_h + offs_d[None, :]
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_ptr + ptr, mask=kv_mask, other=0.0)
        v = tl.load(v_ptr + ptr, mask=kv_mask, other=0.0)
        m_i, l_i, acc = _attend_tile(q, k, v, mask_n[None, :], m_i, l_i, acc, scale, UPCAST)
    out = acc / l_i[:, None]
    tl.store(out_ptr + (start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def _upcast(q: torch.Tensor) -> bool:
    """fp32 math for fp32 inputs and under the interpreter (which computes bf16 wrongly);
    on a GPU fp16/bf16 operands go to the tensor cores as they are, accumulating in fp32."""
    return q.dtype == torch.float32 or os.environ.get("TRITON_INTERPRET") == "1"


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            seq_lens: torch.Tensor, scale: float) -> torch.Tensor:
    """q: [T, H, D]; caches [num_blocks, block_size, Hkv, D] already holding this chunk's
    K/V; cu_seqlens_q [B+1]; seq_lens [B]. Returns [T, H, D] in q's dtype."""
    t, h, d = q.shape
    nb, bs, hkv, dk = k_cache.shape
    b = seq_lens.shape[0]
    assert dk == d and h % hkv == 0 and cu_seqlens_q.shape == (b + 1,)
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and q.stride(-1) == 1
    assert q.device == k_cache.device == cu_seqlens_q.device == block_tables.device
    out = torch.empty_like(q)
    if t == 0:
        return out
    max_q = int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    block_m, block_n = 16, 16
    bt = block_tables.contiguous()
    _prefill_kernel[(b, h, triton.cdiv(max_q, block_m))](
        q, k_cache, v_cache, out, bt, cu_seqlens_q, seq_lens, scale, q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), bt.stride(0), out.stride(0),
        out.stride(1), G=h // hkv, D=d, D_PAD=max(triton.next_power_of_2(d), 16),
        BLOCK_SIZE=bs, BLOCK_M=block_m, BLOCK_N=block_n, UPCAST=_upcast(q))
    return out


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cu_seqlens: torch.Tensor, scale: float) -> torch.Tensor:
    """q/k/v: [T, H, D] (same strides); bidirectional attention within each cu_seqlens
    segment (an image's patches, or one of Qwen2.5-VL's windows)."""
    t, h, d = q.shape
    assert k.shape == v.shape == q.shape and q.device == k.device == cu_seqlens.device
    if not (q.stride() == k.stride() == v.stride() and q.stride(-1) == 1):
        # The kernel takes one set of strides for q, k and v (they usually come as
        # views of one qkv projection; after rotary they may not).
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = torch.empty(t, h, d, dtype=q.dtype, device=q.device)
    n_seg = cu_seqlens.shape[0] - 1
    if t == 0 or n_seg == 0:
        return out
    max_len = int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    block_m, block_n = 16, 16
    _varlen_kernel[(n_seg, h, triton.cdiv(max_len, block_m))](
        q, k, v, out, cu_seqlens, scale, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        D=d, D_PAD=max(triton.next_power_of_2(d), 16), BLOCK_M=block_m, BLOCK_N=block_n,
        UPCAST=_upcast(q))
    return out
