"""Batch metadata the model reads during one forward pass.

The model never sees requests: the runner flattens a step into tensors and sets this
context around the forward call; attention layers read it from here.
"""
from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from types import SimpleNamespace

import torch


@dataclass
class AttentionMetadata:
    """Where each flattened token's K/V goes and what each sequence attends to."""

    slot_mapping: torch.Tensor  # [T] int64: cache slot of each new token (-1 = none)
    block_tables: torch.Tensor  # [B, max_blocks] int32: KV block ids per sequence
    cu_seqlens_q: torch.Tensor  # [B+1] int32: query chunk boundaries in the flat batch
    seq_lens: torch.Tensor  # [B] int32: context length per sequence after this step
    max_query_len: int  # longest query chunk; 1 means a pure decode batch


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
