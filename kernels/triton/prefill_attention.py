"""Triton paged prefill attention and varlen vision attention (flash-attention style).

Prefill: a flattened batch of query chunks (cu_seqlens_q), each attending causally to its
cached prefix and to itself through the block table. Query i of a chunk of length q_len
in a sequence of seq_len tokens sits at position ``seq_len - q_len + i``:

    keys:    0 .................... prefix ......... | chunk (new) |
    query i:                                    sees keys <= seq_len - q_len + i

Grid (H, cdiv(max_q_len, BLOCK_M), B), heads on the fastest-launched axis so the G heads
of a KV group read the same K/V tiles from L2; keys are visited in tiles of BLOCK_N tokens, each
token's cache row found through the block table, so BLOCK_N is independent of block_size.
Vision attention is the same loop without the cache and without the causal mask.
fp32 inputs (and every input under TRITON_INTERPRET=1, which computes bf16 wrongly) are
computed in fp32 with IEEE dots (no TF32); fp16/bf16 on a GPU feed the tensor cores
directly and accumulate in fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl
from triptych.kernels.triton.common import (
    attend_tile,
    check_cache,
    check_tensors,
    interpreting,
    pad_dim,
    require,
    upcast,
)


@triton.jit(do_not_specialize=["stride_btb"])  # (per-step width: one compile)
def _prefill_kernel(q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, bt_ptr, cu_q_ptr, seq_lens_ptr,
                    scale, stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_btb,
                    stride_ot, stride_oh, G: tl.constexpr, D: tl.constexpr,
                    D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_M: tl.constexpr,
                    BLOCK_N: tl.constexpr, UPCAST: tl.constexpr):
    h = tl.program_id(0)  # fastest-launched axis: a GQA group reads its K/V tiles together
    mt = tl.program_id(1)
    b = tl.program_id(2)
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
        m_i, l_i, acc = attend_tile(q, k, v, keep, m_i, l_i, acc, scale, UPCAST)
    out = acc / l_i[:, None]
    tl.store(out_ptr + (q_start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


@triton.jit
def _varlen_kernel(q_ptr, k_ptr, v_ptr, out_ptr, cu_ptr, scale, stride_t, stride_h,
                   stride_ot, stride_oh, D: tl.constexpr, D_PAD: tl.constexpr,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, UPCAST: tl.constexpr):
    h = tl.program_id(0)
    mt = tl.program_id(1)
    seg = tl.program_id(2)
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
        m_i, l_i, acc = attend_tile(q, k, v, mask_n[None, :], m_i, l_i, acc, scale, UPCAST)
    out = acc / l_i[:, None]
    tl.store(out_ptr + (start + offs_m)[:, None] * stride_ot + h * stride_oh + offs_d[None, :],
             out.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_d[None, :])


def _tiles(q: torch.Tensor, d_pad: int, max_len: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, num_warps, num_stages). Interpreter: 16x16 (cheap tests). GPU:
    tensor-core tiles sized so sm_90 needs no register spills (checked with the AOT compile,
    ``cuobjdump --dump-resource-usage``); IEEE fp32 dots need far more registers.

    BLOCK_M shrinks to the longest chunk (16 or 32 rows): since prompts without a cached
    prefix take torch's kernels (kernels/choice.py), this kernel mostly sees a new turn
    or a chunk's tail after a long prefix, where a 64-row tile would multiply zeros."""
    if interpreting():
        return 16, 16, 4, 1
    fit = max(16, triton.next_power_of_2(max(max_len, 1)))
    if q.dtype == torch.float32:
        m, n, w, s = (32, 32, 8, 2) if d_pad <= 128 else (16, 16, 8, 2)
    else:
        m, n, w, s = (64, 64, 4, 3) if d_pad <= 128 else (64, 32, 8, 2)
    return min(m, fit), n, w, s


def paged_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                            block_tables: torch.Tensor, cu_seqlens_q: torch.Tensor,
                            seq_lens: torch.Tensor, scale: float,
                            max_query_len: int | None = None) -> torch.Tensor:
    """Causal attention of each query chunk over its cached prefix and itself.

    q: [T, H, D] (chunks of B sequences, flattened); k_cache, v_cache: [num_blocks,
    block_size, Hkv, D], already holding this chunk's K/V (``reshape_and_cache`` first);
    block_tables: [B, max_blocks] int; cu_seqlens_q: [B+1] int; seq_lens: [B] int, context
    length including the chunk. Returns [T, H, D] in q's dtype. ``max_query_len``: the
    longest chunk, from the host (None reads ``cu_seqlens_q``, a device sync).
    """
    fn = "paged_prefill_attention"
    check_tensors(fn, {"q": q, "k_cache": k_cache, "v_cache": v_cache},
                  {"block_tables": block_tables, "cu_seqlens_q": cu_seqlens_q,
                   "seq_lens": seq_lens})
    check_cache(fn, k_cache, v_cache)
    require(q.dim() == 3, lambda: f"{fn}: q must be [T, H, D], got {tuple(q.shape)}")
    t, h, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    b = seq_lens.shape[0]
    require(q.dtype == k_cache.dtype, lambda: f"{fn}: q is {q.dtype} but the cache is {k_cache.dtype}")
    require(k_cache.shape[3] == d and h % hkv == 0,
            lambda: f"{fn}: q {tuple(q.shape)} does not fit cache {tuple(k_cache.shape)}")
    require(seq_lens.dim() == 1 and cu_seqlens_q.shape == (b + 1,)
            and block_tables.dim() == 2 and block_tables.shape[0] == b,
            lambda: f"{fn}: cu_seqlens_q {tuple(cu_seqlens_q.shape)}, block_tables "
            f"{tuple(block_tables.shape)}, seq_lens {tuple(seq_lens.shape)} disagree on B")
    out = torch.empty_like(q)
    if t == 0 or b == 0:
        return out
    max_q = max_query_len if max_query_len is not None else \
        int((cu_seqlens_q[1:] - cu_seqlens_q[:-1]).max())
    block_m, block_n, warps, stages = _tiles(q, pad_dim(d), max_q)
    bt = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    _prefill_kernel[(h, triton.cdiv(max_q, block_m), b)](
        q, k_cache, v_cache, out, bt, cu_seqlens_q, seq_lens, scale, q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2), bt.stride(0), out.stride(0),
        out.stride(1), G=h // hkv, D=d, D_PAD=pad_dim(d), BLOCK_SIZE=bs, BLOCK_M=block_m,
        BLOCK_N=block_n, UPCAST=upcast(q), num_warps=warps, num_stages=stages)
    return out


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     cu_seqlens: torch.Tensor, scale: float, max_seqlen: int | None = None,
                     cu_seqlens_cpu: torch.Tensor | None = None) -> torch.Tensor:
    """Bidirectional attention within each cu_seqlens segment (an image's patches, or one
    of Qwen2.5-VL's windows); no cache. q, k, v: [T, H, D]; cu_seqlens: [N+1] int.
    ``max_seqlen``: the longest segment, from the host (None reads ``cu_seqlens``, a device
    sync); ``cu_seqlens_cpu`` is the reference's (unused here). Returns [T, H, D] in q's
    dtype."""
    fn = "varlen_attention"
    check_tensors(fn, {"q": q, "k": k, "v": v}, {"cu_seqlens": cu_seqlens})
    require(q.dim() == 3 and k.shape == v.shape == q.shape,
            lambda: f"{fn}: q/k/v must share one [T, H, D] shape, got {tuple(q.shape)}, "
            f"{tuple(k.shape)}, {tuple(v.shape)}")
    require(k.dtype == v.dtype == q.dtype, lambda: f"{fn}: q/k/v dtypes differ")
    require(cu_seqlens.dim() == 1, lambda: f"{fn}: cu_seqlens must be [N+1]")
    t, h, d = q.shape
    if q.stride() != k.stride() or q.stride() != v.stride():
        # One set of strides serves q, k and v (they usually are views of one qkv
        # projection; after rotary they may not be).
        q, k, v = q.contiguous(), k.contiguous(), v.contiguous()
    out = torch.empty(t, h, d, dtype=q.dtype, device=q.device)
    n_seg = cu_seqlens.shape[0] - 1
    if t == 0 or n_seg <= 0:
        return out
    max_len = max_seqlen if max_seqlen is not None else \
        int((cu_seqlens[1:] - cu_seqlens[:-1]).max())
    block_m, block_n, warps, stages = _tiles(q, pad_dim(d), max_len)
    _varlen_kernel[(h, triton.cdiv(max_len, block_m), n_seg)](
        q, k, v, out, cu_seqlens, scale, q.stride(0), q.stride(1), out.stride(0), out.stride(1),
        D=d, D_PAD=pad_dim(d), BLOCK_M=block_m, BLOCK_N=block_n, UPCAST=upcast(q),
        num_warps=warps, num_stages=stages)
    return out
