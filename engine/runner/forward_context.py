"""Batch metadata the model reads during one forward pass.

The model never sees requests: the runner flattens a step into tensors and sets this
context around the forward call; attention layers read it from here.
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import numpy as np
import torch


@dataclass
class AttentionMetadata:
    """Where each flattened token's K/V goes and what each sequence attends to."""

    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token (-1 = none)
    block_tables: torch.Tensor  # [B, max_blocks] int32: KV block ids per sequence
    cu_seqlens_q: torch.Tensor  # [B+1] int32: query chunk boundaries in the flat batch
    seq_lens: torch.Tensor  # [B] int32: context length per sequence after this step
    max_query_len: int  # longest query chunk; 1 means a pure decode batch
    # NOTE: host values, so that no kernel wrapper reads a device tensor back (a sync per
    # layer on a GPU): the longest context, host copies of cu_seqlens_q / seq_lens (None:
    # derived on first use), and whether any slot is -1 (padding rows that write nowhere).
    max_seq_len: int | None = None
    cu_seqlens_q_cpu: np.ndarray | None = None
    seq_lens_cpu: np.ndarray | None = None
    padded: bool | None = None  # None: unknown (looked up on the device)
    # A CUDA graph's decode launch (engine/device/cuda_graphs.py): the split count fixed for the
    # captured batch size, and the tokens per split in a 1-element device tensor
    decode_splits: int | None = None
    decode_partition: torch.Tensor | None = None
    # True when every row's context is exactly its query chunk (prompts' first chunks, no
    # prefix-cache hit, no decode row): attention may run on the step's fresh q/k/v
    # without reading the cache. False (the default) is always safe: the paged path.
    no_cached_prefix: bool = False
    # A mixed step: its first ``num_decodes`` rows compute one token each (the batch puts
    # them first) and take the decode kernel as one slice; the rest the prefill path
    # (``split``). 0: one path for every row (a pure decode step has max_query_len 1).
    num_decodes: int = 0
    # Per-forward values derived from the fields above (gather indices, masks, rotary
    # cos/sin): built by the first layer that needs them, reused by every other layer.
    plans: dict[str, Any] = field(default_factory=dict)

    def split(self) -> tuple[AttentionMetadata, AttentionMetadata]:
        """(decode rows, the other rows) of a mixed step as metadata of their own, made
        once per forward (the prefill rows' cu_seqlens shifted on the device, no read).

            rows:    d d d | p p        cu_seqlens_q: 0 1 2 3 | 9 14
            decode:  d d d              prefill:      0 6 11  (cu[3:] - 3)
        """
        return self.plan("split", self._split)

    def _split(self) -> tuple[AttentionMetadata, AttentionMetadata]:
        nd = self.num_decodes
        assert self.cu_seqlens_q_cpu is not None and self.seq_lens_cpu is not None
        cu, lens = np.asarray(self.cu_seqlens_q_cpu), np.asarray(self.seq_lens_cpu)
        dec = AttentionMetadata(
            slot_mapping=self.slot_mapping[:nd], block_tables=self.block_tables[:nd],
            cu_seqlens_q=self.cu_seqlens_q[:nd + 1], seq_lens=self.seq_lens[:nd],
            max_query_len=1, max_seq_len=int(lens[:nd].max()), cu_seqlens_q_cpu=cu[:nd + 1],
            seq_lens_cpu=lens[:nd], padded=self.padded)
        pcu = cu[nd:] - nd
        plens = lens[nd:]
        pre = AttentionMetadata(
            slot_mapping=self.slot_mapping[nd:], block_tables=self.block_tables[nd:],
            cu_seqlens_q=self.cu_seqlens_q[nd:] - nd, seq_lens=self.seq_lens[nd:],
            max_query_len=int(np.diff(pcu).max()), max_seq_len=int(plens.max()),
            cu_seqlens_q_cpu=pcu, seq_lens_cpu=plens, padded=self.padded,
            no_cached_prefix=bool(np.array_equal(np.diff(pcu), plens)))
        return dec, pre

    def plan(self, key: str, build: Callable[[], Any]) -> Any:
        """``build()`` once per forward pass, memoised under ``key``."""
        value = self.plans.get(key)
        if value is None:
            value = self.plans[key] = build()
        return value


@dataclass
class ForwardContext:
    attn: AttentionMetadata
    kv_caches: list[tuple[torch.Tensor, torch.Tensor]]  # per layer: (k_cache, v_cache)
    ops: SimpleNamespace  # kernel functions of the chosen backend (triptych.kernels.get_ops)


_current: ForwardContext | None = None


@contextmanager
def forward_context(ctx: ForwardContext) -> Iterator[ForwardContext]:
    global _current
    assert _current is None, "forward contexts do not nest"
    _current = ctx
    try:
        yield ctx
    finally:
        _current = None


def get_forward_context() -> ForwardContext:
    assert _current is not None, "attention ran outside forward_context()"
    return _current
