"""Which submodules of a model a process loads: the vision tower, the language model, or both.

An encode worker runs only the tower (and its merger/projector); a prefilling or decoding
worker of a layout with an encode pool runs only the language model. Building just that
part and reading just its checkpoint tensors saves the other part's bytes per worker.

    part        parameters (our names)                         checkpoint tensors read
    vision      visual.*                                       model.visual.* / visual.*
    language    language_model.*, lm_head.*                    model.language_model.* ...
    all         both                                            both

The split is by name prefix, the same for every model of the contract (models/contract.py).
"""
from __future__ import annotations

from typing import Any

PARTS = ("all", "vision", "language")


def check_parts(parts: str) -> str:
    if parts not in PARTS:
        raise ValueError(f"weight parts must be one of {PARTS}, got {parts!r}")
    return parts


def part_of(name: str) -> str:
    """``vision`` or ``language``: which part one of our parameter names belongs to."""
    return "vision" if name.startswith("visual.") else "language"


def holds(parts: str, name: str) -> bool:
    """Whether a model built with ``parts`` has the parameter ``name``."""
    return parts == "all" or part_of(name) == parts


def weight_bytes(model: Any) -> dict[str, int]:
    """Bytes of the weights a model holds, per part (measured, not from the config): its
    parameters, plus the packed copies that replaced the dense weights of linear layers on
    the CPU (``kernels/cpu_linear.pack_linears``: the parameter is left empty)."""
    out = {"vision": 0, "language": 0}
    for name, p in model.named_parameters():
        out[part_of(name)] += p.numel() * p.element_size()
    for name, module in model.named_modules():
        gemm = getattr(module, "cpu_gemm", None)
        for t in (getattr(gemm, "packed", None), getattr(gemm, "bias", None)):
            if t is not None:
                out[part_of(name + ".")] += t.numel() * t.element_size()
    return out
