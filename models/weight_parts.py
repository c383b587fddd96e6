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


def parts_for_pool(pool: str, encode_workers: int) -> str:
    """The parts a worker of ``pool`` runs (every rank of its group alike): an encode
    worker the tower; a prefill or decode worker of a layout with an encode pool the
    language model (its images arrive encoded); everyone else (colocated, P+D, PD, LLM)
    both."""
    if pool == "encode":
        return "vision"
    if pool in ("prefill", "decode") and encode_workers > 0:
        return "language"
    return "all"


def part_of(name: str) -> str:
    """``vision`` or ``language``: which part one of our parameter names belongs to."""
    return "vision" if name.startswith("visual.") else "language"


def holds(parts: str, name: str) -> bool:
    """Whether a model built with ``parts`` has the parameter ``name``."""
    return parts == "all" or part_of(name) == parts


def weight_bytes(model: Any) -> dict[str, int]:
    """Bytes of the parameters a model holds, per part (measured, not from the config);
    a linear layer packed for the CPU (kernels/cpu/linear.py) counts its packed weight.
    NOTE: the LM head's packed copy is made on the first logits and is not counted."""
    out = {"vision": 0, "language": 0}
    for name, p in model.named_parameters():
        out[part_of(name)] += p.numel() * p.element_size()
    for name, m in model.named_modules():
        gemm = getattr(m, "cpu_gemm", None)
        if gemm is not None:
            # + the row-major copy batch-1 steps read (kernels/cpu/gemv.py), if one was made
            out[part_of(name + ".")] += gemm.weight_bytes + gemm.bias_bytes + gemm.gemv_bytes
    return out
