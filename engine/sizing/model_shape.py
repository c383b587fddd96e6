"""What the engine needs to know about a checkpoint, read once from its config, and the
values derived from it and the knobs (device, dtype, max_model_len, KV blocks).

Everything here is computed once per process and passed on explicitly; nothing is written
back into the config.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from triptych.config import EngineConfig

# (the device's choices live in engine/device/platform.py; re-exported for their callers)
from triptych.engine.device.platform import (  # noqa: F401
    resolve_cpu_weights,
    resolve_device,
    resolve_dtype,
)
from triptych.models.contract import contract_for


@dataclass(frozen=True)
class ModelShape:
    """The language model's sizes and special tokens, read once from the HF config."""

    num_layers: int
    num_kv_heads: int
    head_dim: int  # the attention's and the KV cache's (one value: the contract's head_dim)
    max_position_embeddings: int
    spatial_merge_size: int
    tokens_per_second: float | None
    image_token_id: int
    video_token_id: int
    vocab_size: int
    hidden_size: int
    payload_width: int  # columns of one item's encoder payload (>= hidden_size: extras)

    @classmethod
    def from_hf(cls, hf: Any) -> ModelShape:
        """Read through the checkpoint's model contract (ValueError for a config it cannot
        serve: unsupported architecture, a head_dim it refuses, missing DeepStack ...)."""
        contract = contract_for(hf)
        contract.check(hf)
        text = contract.text_config(hf)
        vision = hf.vision_config
        return cls(
            num_layers=text.num_hidden_layers,
            num_kv_heads=text.num_key_value_heads,
            head_dim=contract.head_dim(text),
            max_position_embeddings=text.max_position_embeddings,
            spatial_merge_size=contract.spatial_merge_size(hf),
            tokens_per_second=getattr(vision, "tokens_per_second", None),
            image_token_id=hf.image_token_id,
            video_token_id=getattr(hf, "video_token_id", None) or -1,  # -1: none
            vocab_size=text.vocab_size,
            hidden_size=text.hidden_size,
            payload_width=contract.payload_width(hf),
        )


def resolve_max_model_len(config: EngineConfig, max_position_embeddings: int) -> int:
    """The knob, or the checkpoint's positions capped at 8192 (CPU-friendly default)."""
    return config.max_model_len or min(max_position_embeddings, 8192)


def check_batch_budget(config: EngineConfig, max_model_len: int) -> None:
    """Without chunked prefill a whole prompt must fit one step (ValueError otherwise)."""
    if not config.enable_chunked_prefill and config.max_num_batched_tokens < max_model_len:
        raise ValueError(
            f"with chunked prefill disabled, max_num_batched_tokens "
            f"({config.max_num_batched_tokens}) must be >= max_model_len ({max_model_len})")


def kv_block_bytes(shape: ModelShape, block_size: int, dtype: torch.dtype,
                   num_kv_heads: int | None = None) -> int:
    """Bytes of one KV block: every layer, K and V, ``num_kv_heads`` heads (default all)."""
    elem = torch.tensor([], dtype=dtype).element_size()
    heads = shape.num_kv_heads if num_kv_heads is None else num_kv_heads
    return 2 * shape.num_layers * block_size * heads * shape.head_dim * elem


def num_kv_blocks(config: EngineConfig, shape: ModelShape, dtype: torch.dtype,
                  device: torch.device, tp_size: int = 1) -> int | None:
    """KV blocks of one engine: ``num_kv_blocks``, else what ``kv_cache_memory`` holds, else
    None on CUDA: a profile run sizes the cache from the worker's share of its device
    (engine/sizing/memory.py, parallel/loader.py).

    A block of a tensor-parallel group is split over its ranks by KV heads (replicated when
    heads are fewer than ranks). On CUDA each rank's device has its own budget; on the CPU
    the ranks share the host, so kv_cache_memory is the whole group's."""
    if config.num_kv_blocks:
        return config.num_kv_blocks
    from triptych.engine.sizing.memory import blocks_for, explicit_kv_bytes
    from triptych.models.tp_plan import local_kv_heads

    budget = explicit_kv_bytes(config, device.type)
    if budget is None:
        return None
    per_block = kv_block_bytes(shape, config.block_size, dtype,
                               local_kv_heads(shape.num_kv_heads, tp_size))
    if device.type != "cuda":
        per_block *= tp_size
    return blocks_for(budget, per_block, "kv_cache_memory")
