"""Load a local HF checkpoint directory (config.json + safetensors) into a triptych model."""
from __future__ import annotations

import json
import os
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch
from safetensors import safe_open
from triptych.models.contract import contract_for

if TYPE_CHECKING:  # the type only: models stand below parallel/
    from triptych.parallel.context import TPContext


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


class LazyTensor:
    """A checkpoint tensor not read yet: its shape, and ``read`` for all of it or a range of
    one dim (a tensor-parallel rank reads only its slice). Valid while its file is open."""

    def __init__(self, file: Any, name: str) -> None:
        self._slice = file.get_slice(name)
        self.shape = tuple(self._slice.get_shape())

    def read(self, dim: int = 0, src: tuple[int, int] | None = None) -> torch.Tensor:
        if src is None:
            return self._slice[:]
        return self._slice[(slice(None),) * dim + (slice(src[0], src[1]),)]


def iter_weights(model_dir: str) -> Iterator[tuple[str, LazyTensor]]:
    """(name, lazy tensor) of every checkpoint tensor, one shard file open at a time; the
    consumer reads what it needs before asking for the next."""
    for path in safetensors_files(model_dir):
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                yield name, LazyTensor(f, name)


def load_model(model_dir: str, dtype: torch.dtype, device: str,
               attention_backend: str = "torch", tp: TPContext | None = None,
               shard_vision: bool = True, cpu_weights: str | None = None,
               parts: str = "all"
               ) -> tuple[Any, Any]:
    """(model in eval mode on ``device``, HF config) from a local checkpoint directory.

    With ``tp``, this rank's shard of the model (``shard_vision`` False: whole vision tower).
    ``parts``: build and read only the vision tower or only the language model
    (models/weight_parts.py); the other part's tensors are never read from the files.
    ``cpu_weights`` (float32 | bfloat16 | float16 | int8): an fp32 model on the CPU runs
    its linear layers (and LM head) on weights packed once in that format
    (kernels/cpu/linear.py); the engine's processes ask for it.
    Never downloads. Raises ValueError for an unsupported architecture, a missing tensor or
    a shape mismatch."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(model_dir, local_files_only=True)
    model = contract_for(config).build(config, dtype, device, attention_backend, tp=tp,
                                       shard_vision=shard_vision, parts=parts)
    model.load_weights(iter_weights(model_dir))
    model = model.eval().requires_grad_(False)
    if cpu_weights and dtype == torch.float32:  # (a CPU engine's choice: engine/device/platform.py)
        from triptych.engine.device.platform import cpu_kernels
        from triptych.kernels.cpu.linear import available, pack_linears

        cpu_kernels()  # this CPU's kernels, chosen once per process (an engine chose at start)

        if available(cpu_weights) or cpu_weights != "float32":  # else: F.linear, logged
            pack_linears(model, cpu_weights)
            model.pack_head = cpu_weights  # compute_logits packs its own copy of the head
    return model, config
