"""Triton paged decode attention with split-K (flash-decoding).

One query token per sequence. Grid (B, Hkv, num_splits): a program takes one KV head and
the G = H / Hkv query heads that share it (each K/V tile is loaded once for the group),
and one partition of the sequence. Partials (running max m, sum l, unnormalised out) go
to a workspace; a second kernel merges the partitions:

    seq:  |---- split 0 ----|---- split 1 ----|-- split 2 --|
    out = sum_s exp(m_s - M) * acc_s / sum_s exp(m_s - M) * l_s,   M = max_s m_s

Loads are upcast to fp32 (the interpreter computes bf16 wrongly otherwise; on GPU it is
also where accumulation happens), so fp16 / bf16 / fp32 inputs all accumulate in fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _decode_split_kernel(q_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, seq_lens_ptr,
                         part_out_ptr, part_m_ptr, part_l_ptr, scale,
                         stride_qb, stride_qh, stride_kb, stride_ks, stride_kh,
                         stride_btb, stride_pb, stride_ph, stride_ps,
                         G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                         D_PAD: tl.constexpr, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                         PARTITION: tl.constexpr, NUM_SPLITS: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    start = split * PARTITION
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D_PAD)
    mask_g = offs_g < G
    mask_d = offs_d < D
    heads = kvh * G + offs_g
    # q: [G_PAD, D_PAD] fp32
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_g[:, None] & mask_d[None, :], other=0.0).to(tl.float32)
    m_i = tl.full([G_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, D_PAD], tl.float32)
    end = tl.minimum(start + PARTITION, seq_len)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        # token -> (block id via the block table, offset in block)
        blk = tl.load(bt_ptr + b * stride_btb + offs_n // BLOCK_SIZE, mask=mask_n, other=0)
        row = blk.to(tl.int64) * stride_kb + (offs_n % BLOCK_SIZE) * stride_ks + kvh * stride_kh
        kv_mask = mask_n[:, None] & mask_d[None, :]
        k = tl.load(k_cache_ptr + row[:, None] + offs_d[None, :], mask=kv_mask,
                    other=0.0).to(tl.float32)  # [BLOCK_N, D_PAD]
        v = tl.load(v_cache_ptr + row[:, None] + offs_d[None, :], mask=kv_mask,
                    other=0.0).to(tl.float32)
        s = tl.sum(q[:, None, :] * k[None, :, :], axis=2) * scale  # [G_PAD, BLOCK_N]
        s = tl.where(mask_n[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, axis=1))
        alpha = tl.exp(m_i - m_new)
        p = tl.exp(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, axis=1)
        acc = acc * alpha[:, None] + tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        m_i = m_new
    base = b * stride_pb + heads * stride_ph + split * stride_ps
    tl.store(part_m_ptr + base // D_PAD, m_i, mask=mask_g)
    tl.store(part_l_ptr + base // D_PAD, l_i, mask=mask_g)
    tl.store(part_out_ptr + base[:, None] + offs_d[None, :], acc, mask=mask_g[:, None])


@triton.jit
def _decode_reduce_kernel(part_out_ptr, part_m_ptr, part_l_ptr, out_ptr, seq_lens_ptr,
                          stride_pb, stride_ph, stride_ps, stride_ob, stride_oh,
                          D: tl.constexpr, D_PAD: tl.constexpr, PARTITION: tl.constexpr,
                          S_PAD: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    seq_len = tl.load(seq_lens_ptr + b)
    n_splits = tl.cdiv(seq_len, PARTITION)
    offs_s = tl.arange(0, S_PAD)
    offs_d = tl.arange(0, D_PAD)
    mask_s = offs_s < n_splits
    base = b * stride_pb + h * stride_ph + offs_s * stride_ps
    m = tl.load(part_m_ptr + base // D_PAD, mask=mask_s, other=float("-inf"))
    lsum = tl.load(part_l_ptr + base // D_PAD, mask=mask_s, other=0.0)
    m_max = tl.max(m, axis=0)
    w = tl.where(mask_s, tl.exp(m - m_max), 0.0)
    acc = tl.load(part_out_ptr + base[:, None] + offs_d[None, :], mask=mask_s[:, None], other=0.0)
    out = tl.sum(acc * w[:, None], axis=0) / tl.sum(lsum * w, axis=0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d,
             out.to(out_ptr.dtype.element_ty), mask=offs_d < D)


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           partition_size: int | None = None) -> torch.Tensor:
    """q: [B, H, D]; caches [num_blocks, block_size, Hkv, D]; block_tables [B, max_blocks];
    seq_lens [B] (>= 1). Returns [B, H, D] in q's dtype. ``partition_size`` (tokens per
    split, a multiple of the tile) defaults to 512, or less so that few long sequences
    still give the GPU enough programs."""
    b, h, d = q.shape
    nb, bs, hkv, dk = k_cache.shape
    assert dk == d and h % hkv == 0 and v_cache.shape == k_cache.shape
    assert k_cache.is_contiguous() and v_cache.is_contiguous() and q.stride(-1) == 1
    assert block_tables.shape[0] == b and seq_lens.shape == (b,)
    assert q.device == k_cache.device == block_tables.device == seq_lens.device
    out = torch.empty_like(q)
    if b == 0:
        return out
    g = h // hkv
    block_n = 16
    max_len = int(seq_lens.max())
    if partition_size is None:
        partition_size = 512
        # Fill the GPU: aim for >= ~256 programs when the batch is small.
        while partition_size > 64 and b * hkv * triton.cdiv(max_len, partition_size) < 256:
            partition_size //= 2
    assert partition_size % block_n == 0
    splits = triton.cdiv(max_len, partition_size)
    d_pad = triton.next_power_of_2(d)
    part_out = torch.empty(b, h, splits, d_pad, dtype=torch.float32, device=q.device)
    part_m = torch.empty(b, h, splits, dtype=torch.float32, device=q.device)
    part_l = torch.empty(b, h, splits, dtype=torch.float32, device=q.device)
    bt = block_tables.contiguous()
    # part_m / part_l share part_out's (b, h, split) index scaled by 1/D_PAD.
    _decode_split_kernel[(b, hkv, splits)](
        q, k_cache, v_cache, bt, seq_lens, part_out, part_m, part_l, scale,
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        bt.stride(0), part_out.stride(0), part_out.stride(1), part_out.stride(2),
        G=g, G_PAD=max(triton.next_power_of_2(g), 1), D=d, D_PAD=d_pad, BLOCK_SIZE=bs,
        BLOCK_N=block_n, PARTITION=partition_size, NUM_SPLITS=splits)
    _decode_reduce_kernel[(b, h)](
        part_out, part_m, part_l, out, seq_lens, part_out.stride(0), part_out.stride(1),
        part_out.stride(2), out.stride(0), out.stride(1), D=d, D_PAD=d_pad,
        PARTITION=partition_size, S_PAD=max(triton.next_power_of_2(splits), 1))
    return out
