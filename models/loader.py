"""Load a local HF checkpoint directory (config.json + safetensors) into a triptych model."""
from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import Any

import torch
from safetensors import safe_open
from triptych.models.registry import resolve_model_class


def safetensors_files(model_dir: str) -> list[str]:
    """The checkpoint's safetensors files: the sharded index's, else model.safetensors."""
    index = os.path.join(model_dir, "model.safetensors.index.json")
    if os.path.exists(index):
        with open(index) as f:
            shards = sorted(set(json.load(f)["weight_map"].values()))
        return [os.path.join(model_dir, s) for s in shards]
    single = os.path.join(model_dir, "model.safetensors")
    if os.path.exists(single):
        return [single]
    raise FileNotFoundError(f"no model.safetensors or model.safetensors.index.json in {model_dir}")


def iter_weights(model_dir: str) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) of every checkpoint tensor, one shard open at a time, on the host."""
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                yield name, f.get_tensor(name)


def load_model(model_dir: str, dtype: torch.dtype, device: str,
               attention_backend: str = "torch") -> tuple[Any, Any]:
    """(model in eval mode on ``device``, HF config) from a local checkpoint directory.

    Never downloads. Raises ValueError for an unsupported architecture, a missing tensor or
    a shape mismatch."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    cls = resolve_model_class(getattr(config, "architectures", None))
    model = cls(config, dtype=dtype, device=device, attention_backend=attention_backend)
    model.load_weights(iter_weights(model_dir))
    return model.eval().requires_grad_(False), config
