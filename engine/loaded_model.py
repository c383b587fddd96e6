"""LoadedModel: what a worker process runs, as ``parallel/loader.py`` built it.

The loader picks the parts (one process, or rank 0 of a tensor-parallel group with its
runner and encoder driving the ranks); the engine core and the encode worker take them
as they are, so ``engine/`` never needs to know how a group is started.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
from triptych.engine.encoder.encoder_runner import EncoderRunner
from triptych.engine.runner.model_runner import ModelRunner
from triptych.engine.sizing.model_shape import ModelShape


@dataclass
class LoadedModel:
    """A role's model and runners. ``runner`` / ``num_blocks``: the engine role only."""

    model: Any  # models.Qwen2VLForCausalLM (rank 0's shard in a group)
    hf_config: Any  # the checkpoint's transformers config
    shape: ModelShape
    device: torch.device
    dtype: torch.dtype
    attention_backend: str  # torch | cpu | triton
    max_model_len: int  # resolved from the knob and the checkpoint
    encoder: EncoderRunner  # the vision tower behind its cache (the group's, in a group)
    runner: ModelRunner | None = None  # None for the encode role
    num_blocks: int = 0  # KV blocks of the runner's cache (agreed by every rank)
    group: Any = None  # rank 0's TPGroup (parallel/group.py), None for one process
    weight_parts: str = "all"  # all | vision | language: the submodules this process built
    weight_bytes: dict[str, int] | None = None  # measured bytes per part (vision, language)
    # each rank's weight_bytes, rank 0 first, as each process measured its own (a group)
    rank_weight_bytes: list[dict[str, int]] | None = None
    gpu_memory_share: float = 0.0  # CUDA: the share of its device it measured it needs
    # (an encode worker, engine/sizing/memory.py), 0: not measured

    def weight_stats(self) -> dict[str, float]:
        """The worker's resident weight bytes per part, all its ranks together, for its
        stats (and /metrics)."""
        out: dict[str, float] = {}
        for held in self.rank_weight_bytes or [self.weight_bytes or {}]:
            for k, v in held.items():
                out[f"weight_bytes_{k}"] = out.get(f"weight_bytes_{k}", 0.0) + v
        return out

    def group_weight_bytes(self) -> list[dict[str, int]]:
        """Each rank's weight bytes in a group ([] for one process: ``weight_bytes``)."""
        return [dict(r) for r in self.rank_weight_bytes or []] if self.group is not None else []

    @property
    def tp_size(self) -> int:
        return self.group.size if self.group is not None else 1

    def close(self) -> None:
        """Stop the tensor-parallel ranks (nothing to do for one process)."""
        if self.group is not None:
            self.group.close()
