"""Paged self-attention for the language model: write new K/V, attend over the cache.

Per phase: a pure decode step runs the decode kernel; a prefill step the fresh q/k/v path
(no cached prefix, kernels/choice.py) or the paged prefill; a mixed step (chunked prefill
beside running decodes, the common case under load) runs its decode rows, which the batch
puts first, through the decode kernel (split-K, one program per KV head group) and the
rest through the prefill path: a 32K-context decode row is not walked by 64-row tiles.
"""
from __future__ import annotations

from typing import Any

import torch
from torch import nn
from triptych.engine.runner.forward_context import AttentionMetadata, get_forward_context


class PagedAttention(nn.Module):
    """Stores this step's K/V in the layer's paged cache, then attends causally.

    q: [T, H, D], k/v: [T, Hkv, D] for the flat batch described by the forward context.
    """

    def __init__(self, layer_idx: int, num_heads: int, num_kv_heads: int, head_dim: int,
                 scale: float) -> None:
        super().__init__()
        assert num_heads % num_kv_heads == 0
        self.layer_idx = layer_idx
        self.num_heads, self.num_kv_heads, self.head_dim = num_heads, num_kv_heads, head_dim
        self.scale = scale

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        ctx = get_forward_context()
        meta, ops = ctx.attn, ctx.ops
        k_cache, v_cache = ctx.kv_caches[self.layer_idx]
        # An op exposing ``make_plan`` (the torch reference) gets the per-forward gather
        # indices and masks built once, by the first layer, instead of in every layer.
        fn = ops.reshape_and_cache
        make = getattr(fn, "make_plan", None)
        extra = {} if make is None else {"plan": meta.plan(
            "cache", lambda: make(meta.slot_mapping, meta.padded))}
        fn(k, v, k_cache, v_cache, meta.slot_mapping, **extra)
        # NOTE: the host knows every size a kernel launch needs (max lengths): passed down,
        # so no backend reads a device value back inside the forward.
        if meta.max_query_len == 1:
            return self._decode(q, k_cache, v_cache, meta, ops)
        if meta.num_decodes:  # a mixed step: decode rows (first) through the decode kernel
            dec, pre = meta.split()
            nd = meta.num_decodes
            out = torch.empty_like(q)
            out[:nd] = self._decode(q[:nd], k_cache, v_cache, dec, ops)
            out[nd:] = self._prefill(q[nd:], k[nd:], v[nd:], k_cache, v_cache, pre, ops)
            return out
        return self._prefill(q, k, v, k_cache, v_cache, meta, ops)

    def _decode(self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
                meta: AttentionMetadata, ops: Any) -> torch.Tensor:
        fn = ops.paged_decode_attention
        make = getattr(fn, "make_plan", None)
        bs = k_cache.shape[1]
        extra = {"max_seq_len": meta.max_seq_len} if make is None else {
            "plan": meta.plan("decode", lambda: make(meta.block_tables, meta.seq_lens, bs,
                                                     meta.max_seq_len))}
        if meta.decode_splits is not None:  # a CUDA graph's fixed launch (triton)
            extra.update(num_splits=meta.decode_splits, partition=meta.decode_partition)
        return fn(q, k_cache, v_cache, meta.block_tables, meta.seq_lens, self.scale, **extra)

    def _prefill(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 k_cache: torch.Tensor, v_cache: torch.Tensor, meta: AttentionMetadata,
                 ops: Any) -> torch.Tensor:
        fresh = ops.varlen_causal_attention
        if fresh is not None and meta.no_cached_prefix:  # (kernels/choice.py: no cache read)
            runs = meta.plan("runs", lambda: fresh.make_plan(meta.cu_seqlens_q_cpu))
            return fresh(q, k, v, meta.cu_seqlens_q, self.scale, max_seqlen=meta.max_query_len,
                         cu_seqlens_cpu=meta.cu_seqlens_q_cpu, plan=runs)
        fn = ops.paged_prefill_attention
        make = getattr(fn, "make_plan", None)
        bs = k_cache.shape[1]
        extra = {"max_query_len": meta.max_query_len} if make is None else {
            "plan": meta.plan("prefill", lambda: make(
                meta.block_tables, meta.cu_seqlens_q, meta.seq_lens, bs, meta.cu_seqlens_q_cpu,
                meta.seq_lens_cpu))}
        return fn(q, k_cache, v_cache, meta.block_tables, meta.cu_seqlens_q, meta.seq_lens,
                  self.scale, **extra)
