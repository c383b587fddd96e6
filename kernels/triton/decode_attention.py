"""Triton paged decode attention with split-K (flash-decoding).

One query token per sequence. Grid (B, Hkv, num_splits): a program takes one KV head and
the G = H / Hkv query heads that share it, padded to BLOCK_H >= 16 rows so both products
run as ``tl.dot`` (tensor cores on a GPU; each K/V tile is loaded once for the group), over
one partition of the sequence, in tiles of BLOCK_N tokens found through the block table:

    block_table[b]: | 7 | 2 | 9 | 4 | ...      token n -> k_cache[bt[n // bs], n % bs, kvh]
    tokens:         |---- split 0 ----|---- split 1 ----|-- split 2 --|   (partition P)

Each split writes its partial (running max m, sum l, unnormalised out acc) to an fp32
workspace and a second kernel merges them:

    out = sum_s exp(m_s - M) * acc_s / sum_s exp(m_s - M) * l_s,   M = max_s m_s

With one split (big batches) the first kernel normalises and writes the output itself.
The partition is a runtime argument, not a constexpr: the split count changes as contexts
grow, and a constexpr would recompile the kernel for every new value.

Inside a CUDA graph (engine/device/cuda_graphs.py) no launch parameter may change between
replays: the split count is fixed per captured batch size (``num_splits``) and the
partition is read from device memory (``partition_ptr``, written with the step's inputs),
so one graph serves every context length with all its splits busy. A row of length 0 (a
padding row) gives zeros, never 0 / 0.

Loads are upcast to fp32 for fp32 inputs and under TRITON_INTERPRET=1 (the interpreter
computes bf16 wrongly otherwise); every dtype accumulates in fp32.
"""
from __future__ import annotations

import torch
import triton
import triton.language as tl

from triptych.kernels.triton.common import (
    attend_tile, check_cache, check_tensors, interpreting, num_sms, pad_dim, require, upcast)

MAX_PARTITION = 4096  # tokens: a long sequence among short ones is not left as the tail
S_BLOCK = 16  # splits merged per step of the reduce kernel


# NOTE: ints that change from step to step are not specialised on (== 1, % 16): each value
# class would be another compile, met first by some request (issue 40 row 9)
@triton.jit(do_not_specialize=["partition", "num_splits", "stride_btb"])
def _decode_split_kernel(q_ptr, k_cache_ptr, v_cache_ptr, bt_ptr, seq_lens_ptr, out_ptr,
                         part_out_ptr, part_m_ptr, part_l_ptr, scale, partition, part_ptr,
                         num_splits, stride_qb, stride_qh, stride_kb, stride_ks, stride_kh,
                         stride_btb, stride_ob, stride_oh, G: tl.constexpr,
                         BLOCK_H: tl.constexpr, D: tl.constexpr, D_PAD: tl.constexpr,
                         BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr,
                         ONE_SPLIT: tl.constexpr, UPCAST: tl.constexpr,
                         PART_IN_MEMORY: tl.constexpr):
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + b)
    if PART_IN_MEMORY:  # (a CUDA graph: the step wrote it)
        partition = tl.load(part_ptr)
    start = split * partition
    if split > 0 and start >= seq_len:  # a shorter sequence: the reduce skips this split
        return  # (split 0 always runs: a row of length 0 writes an empty partial)
    end = tl.minimum(start + partition, seq_len)
    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, D_PAD)
    mask_h = offs_h < G
    mask_d = offs_d < D
    heads = kvh * G + offs_h
    # q: [BLOCK_H, D_PAD]; padded rows are zeros and never stored
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                mask=mask_h[:, None] & mask_d[None, :], other=0.0)
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_H], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_H], tl.float32)
    acc = tl.zeros([BLOCK_H, D_PAD], tl.float32)
    for n0 in range(start, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        blk = tl.load(bt_ptr + b * stride_btb + offs_n // BLOCK_SIZE, mask=mask_n, other=0)
        row = blk.to(tl.int64) * stride_kb + (offs_n % BLOCK_SIZE) * stride_ks + kvh * stride_kh
        kv_mask = mask_n[:, None] & mask_d[None, :]
        # k, v: [BLOCK_N, D_PAD]; masked tokens load 0 (not garbage: p * NaN would be NaN)
        k = tl.load(k_cache_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        v = tl.load(v_cache_ptr + row[:, None] + offs_d[None, :], mask=kv_mask, other=0.0)
        m_i, l_i, acc = attend_tile(q, k, v, mask_n[None, :], m_i, l_i, acc, scale, UPCAST)
    if ONE_SPLIT:
        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]  # (length 0: zeros, not 0 / 0)
        tl.store(out_ptr + b * stride_ob + heads[:, None] * stride_oh + offs_d[None, :],
                 out.to(out_ptr.dtype.element_ty), mask=mask_h[:, None] & mask_d[None, :])
    else:
        # workspace index of (b, head, split): part_m/part_l [B, H, S], part_out [B, H, S, D_PAD]
        idx = (b * tl.num_programs(1) * G + heads) * num_splits + split
        tl.store(part_m_ptr + idx, m_i, mask=mask_h)
        tl.store(part_l_ptr + idx, l_i, mask=mask_h)
        tl.store(part_out_ptr + idx.to(tl.int64)[:, None] * D_PAD + offs_d[None, :], acc,
                 mask=mask_h[:, None])


@triton.jit(do_not_specialize=["partition", "num_splits"])
def _decode_reduce_kernel(part_out_ptr, part_m_ptr, part_l_ptr, out_ptr, seq_lens_ptr,
                          partition, part_ptr, num_splits, stride_ob, stride_oh,
                          D: tl.constexpr, D_PAD: tl.constexpr, S_BLOCK: tl.constexpr,
                          PART_IN_MEMORY: tl.constexpr):
    b = tl.program_id(0)
    h = tl.program_id(1)
    if PART_IN_MEMORY:
        partition = tl.load(part_ptr)
    n_splits = tl.cdiv(tl.load(seq_lens_ptr + b), partition)  # this sequence's own count
    base = (b * tl.num_programs(1) + h) * num_splits
    offs_d = tl.arange(0, D_PAD)
    # Online merge, S_BLOCK splits at a time (bounded registers for any split count).
    m_run = tl.full([], float("-inf"), tl.float32)
    l_run = tl.zeros([], tl.float32)
    acc = tl.zeros([D_PAD], tl.float32)
    for s0 in range(0, n_splits, S_BLOCK):
        offs_s = s0 + tl.arange(0, S_BLOCK)
        mask_s = offs_s < n_splits
        m = tl.load(part_m_ptr + base + offs_s, mask=mask_s, other=float("-inf"))
        lsum = tl.load(part_l_ptr + base + offs_s, mask=mask_s, other=0.0)
        part = tl.load(part_out_ptr + (base + offs_s).to(tl.int64)[:, None] * D_PAD
                       + offs_d[None, :], mask=mask_s[:, None], other=0.0)  # [S_BLOCK, D_PAD]
        m_new = tl.maximum(m_run, tl.max(m, axis=0))  # finite: split s0 has tokens
        alpha = tl.exp(m_run - m_new)
        w = tl.exp(m - m_new)  # masked splits: exp(-inf) = 0
        l_run = l_run * alpha + tl.sum(lsum * w, axis=0)
        acc = acc * alpha + tl.sum(part * w[:, None], axis=0)
        m_run = m_new
    l_run = tl.where(l_run > 0, l_run, 1.0)  # a row of length 0: zeros, not 0 / 0
    tl.store(out_ptr + b * stride_ob + h * stride_oh + offs_d,
             (acc / l_run).to(out_ptr.dtype.element_ty), mask=offs_d < D)


def _config(q: torch.Tensor, d_pad: int) -> tuple[int, int, int]:
    """(BLOCK_N, num_warps, num_stages). Interpreter: 16-token tiles keep tests cheap. GPU:
    sized so sm_90 needs no register spills (AOT compile, ``cuobjdump
    --dump-resource-usage``): bf16 D=128 at 64 tokens, 4 warps is ~120 registers, ~39 KB
    of pipelined shared memory; IEEE fp32 dots need far more registers."""
    if interpreting():
        return 16, 4, 1
    if q.dtype == torch.float32:
        return (32, 4, 2) if d_pad <= 128 else (16, 8, 2)
    return (64, 4, 3) if d_pad <= 128 else (32, 4, 3)


def choose_splits(batch: int, num_kv_heads: int, max_len: int, block_n: int, sms: int
                  ) -> int:
    """How many splits a context of ``max_len`` tokens is cut into: enough programs
    (batch x KV heads x splits) to fill the device about 3 times over, none shorter than
    one tile (the merge and launch overhead win there), none longer than MAX_PARTITION.

    A CUDA graph fixes this per captured batch size, with ``max_len`` the longest context
    the engine allows (engine/device/cuda_graphs.py)."""
    splits = triton.cdiv(3 * sms, batch * num_kv_heads)
    splits = min(splits, triton.cdiv(max_len, block_n))
    return max(splits, triton.cdiv(max_len, MAX_PARTITION), 1)


def partition_for(max_len: int, splits: int, block_n: int) -> int:
    """Tokens per split so that ``splits`` splits cover ``max_len``: a multiple of
    ``block_n`` (never less than one tile)."""
    return max(block_n, triton.cdiv(triton.cdiv(max_len, splits), block_n) * block_n)


def choose_partition(batch: int, num_kv_heads: int, max_len: int, block_n: int,
                     sms: int) -> int:
    """Tokens per split for an eager launch (``choose_splits``, then ``partition_for``)."""
    return partition_for(max_len, choose_splits(batch, num_kv_heads, max_len, block_n, sms),
                         block_n)


def decode_block_n(dtype: torch.dtype, head_dim: int) -> int:
    """The key tile of the decode kernel for this dtype and head size (a partition written
    into device memory must be a multiple of it)."""
    return _config(torch.empty(0, dtype=dtype), pad_dim(head_dim))[0]


def paged_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                           block_tables: torch.Tensor, seq_lens: torch.Tensor, scale: float,
                           max_seq_len: int | None = None,
                           partition_size: int | None = None, num_splits: int | None = None,
                           partition: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of one new token per sequence over its paged context (GQA aware).

    q: [B, H, D]; k_cache, v_cache: [num_blocks, block_size, Hkv, D] (contiguous);
    block_tables: [B, max_blocks] int; seq_lens: [B] int, each >= 1, context length
    including the query token. Returns [B, H, D] in q's dtype. ``max_seq_len``: the
    longest context, from the host (the engine always passes it; None reads ``seq_lens``,
    a device sync). ``partition_size`` (tokens per split, a multiple of 16) overrides
    ``choose_partition``; tests force split-K with it. ``num_splits`` + ``partition`` (a
    1-element int32 device tensor holding the tokens per split, a multiple of
    ``decode_block_n``) fix the launch for a CUDA graph: the grid does not depend on the
    lengths, and ``max_seq_len`` is then unused.
    """
    fn = "paged_decode_attention"
    check_tensors(fn, {"q": q, "k_cache": k_cache, "v_cache": v_cache},
                  {"block_tables": block_tables, "seq_lens": seq_lens})
    check_cache(fn, k_cache, v_cache)
    require(q.dim() == 3, lambda: f"{fn}: q must be [B, H, D], got {tuple(q.shape)}")
    b, h, d = q.shape
    _, bs, hkv, _ = k_cache.shape
    require(q.dtype == k_cache.dtype, lambda: f"{fn}: q is {q.dtype} but the cache is {k_cache.dtype}")
    require(k_cache.shape[3] == d and h % hkv == 0,
            lambda: f"{fn}: q {tuple(q.shape)} does not fit cache {tuple(k_cache.shape)}")
    require(block_tables.dim() == 2 and block_tables.shape[0] == b and seq_lens.shape == (b,),
            lambda: f"{fn}: block_tables {tuple(block_tables.shape)} / seq_lens "
            f"{tuple(seq_lens.shape)} do not match batch {b}")
    out = torch.empty_like(q)
    if b == 0:
        return out
    g = h // hkv
    d_pad = pad_dim(d)
    block_n, warps, stages = _config(q, d_pad)
    in_memory = num_splits is not None
    if in_memory:
        require(partition is not None and partition.numel() == 1 and num_splits >= 1,
                lambda: f"{fn}: num_splits needs partition (a 1-element device tensor)")
        splits, part = num_splits, 0
    else:
        max_len = max_seq_len if max_seq_len is not None else int(seq_lens.max())
        if partition_size is None:
            part = choose_partition(b, hkv, max_len, block_n, num_sms(q.device))
        else:
            require(partition_size > 0 and partition_size % 16 == 0,
                    lambda: f"{fn}: partition_size must be a positive multiple of 16")
            part = partition_size
            while part % block_n:
                block_n //= 2
        splits = triton.cdiv(max_len, part)
    part_ptr = partition if in_memory else seq_lens  # (unread unless PART_IN_MEMORY)
    bt = block_tables if block_tables.stride(-1) == 1 else block_tables.contiguous()
    if splits > 1:
        part_out = torch.empty(b, h, splits, d_pad, dtype=torch.float32, device=q.device)
        part_m = torch.empty(b, h, splits, dtype=torch.float32, device=q.device)
        part_l = torch.empty_like(part_m)
    else:
        part_out = part_m = part_l = out  # unused by the one-split path
    _decode_split_kernel[(b, hkv, splits)](
        q, k_cache, v_cache, bt, seq_lens, out, part_out, part_m, part_l, scale, part,
        part_ptr, splits, q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1),
        k_cache.stride(2), bt.stride(0), out.stride(0), out.stride(1), G=g,
        BLOCK_H=max(triton.next_power_of_2(g), 16), D=d, D_PAD=d_pad, BLOCK_SIZE=bs,
        BLOCK_N=block_n, ONE_SPLIT=splits == 1, UPCAST=upcast(q), num_warps=warps,
        num_stages=stages, PART_IN_MEMORY=in_memory)
    if splits > 1:
        _decode_reduce_kernel[(b, h)](
            part_out, part_m, part_l, out, seq_lens, part, part_ptr, splits, out.stride(0),
            out.stride(1), D=d, D_PAD=d_pad, S_BLOCK=S_BLOCK, PART_IN_MEMORY=in_memory)
    return out
