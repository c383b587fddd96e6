"""Checkpoint tensor names -> our parameter names, and reading one piece of a tensor.

Checkpoints name the same tensor two ways: the hub / transformers-4 layout (``model.*`` for
the language model, ``visual.*``) and the transformers-5 save (``model.language_model.*``,
``model.visual.*``). Every model of the contract maps both onto ``language_model.*`` /
``visual.*`` / ``lm_head.*``; a tensor-parallel rank reads only its slice (``Shard``).
"""
from __future__ import annotations

from typing import Any

import torch
from triptych.models.parallel_layers import Shard


def read_piece(ckpt_name: str, tensor: Any, sh: Shard, want: tuple[int, ...]) -> torch.Tensor:
    """The piece ``sh`` of a checkpoint tensor, shape-checked against the parameter slice
    ``want`` it goes to (the whole tensor's shape is checked before any slice is read)."""
    shape = tuple(tensor.shape)
    if sh.src is None:
        if len(shape) == 5 and len(want) == 2:  # Conv3d kernel -> linear weight
            shape = (shape[0], shape[1] * shape[2] * shape[3] * shape[4])
        expected = want
    else:
        expected = want[:sh.dim] + (sh.full,) + want[sh.dim + 1:]
    if shape != expected:
        raise ValueError(f"checkpoint tensor {ckpt_name!r} has shape {shape} but the model "
                         f"expects {expected}")
    if isinstance(tensor, torch.Tensor):
        out = tensor if sh.src is None else tensor.narrow(sh.dim, sh.src[0], sh.src[1] - sh.src[0])
    else:
        out = tensor.read(sh.dim, sh.src) if sh.src is not None else tensor.read()
    return out.reshape(want)


# checkpoint prefix -> our prefix; first match wins (transformers-5 names before hub names)
_PREFIXES = (
    ("model.language_model.", "language_model."),
    ("model.visual.", "visual."),
    # InternVL-HF: its hub files keep the legacy layout (transformers 5 saves it too)
    ("model.vision_tower.", "visual.vision_tower."),
    ("model.multi_modal_projector.", "visual.multi_modal_projector."),
    ("vision_tower.", "visual.vision_tower."),
    ("multi_modal_projector.", "visual.multi_modal_projector."),
    ("language_model.model.", "language_model."),
    ("language_model.lm_head.", "lm_head."),
    ("visual.", "visual."),
    ("model.", "language_model."),
    ("lm_head.", "lm_head."),
)


def hub_name(name: str) -> str:
    """The hub/transformers-4 checkpoint name of one of our parameters (for messages)."""
    if name.startswith("language_model."):
        return "model." + name[len("language_model."):]
    return name


def map_checkpoint_name(name: str) -> str | None:
    """Our parameter name for a checkpoint tensor name, or None if it is not ours."""
    for src, dst in _PREFIXES:
        if name.startswith(src):
            return dst + name[len(src):]
    return None
