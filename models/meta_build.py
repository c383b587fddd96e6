"""Building a model's modules on the meta device, without their initialisers.

A module built under ``torch.device("meta")`` still runs its ``reset_parameters``; the
random ones (``normal_``, ``uniform_``) dispatch through torch's reference ops, and the
first such call imports ``torch._dynamo``: ~1.2 s of CPU in every process that builds a
model (each worker, each ``LLM``), for values that are garbage anyway (``load_weights``
fills them). Inside ``on_meta()`` the initialisers do nothing, as inside HF's
``no_init_weights``.
"""
from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator

import torch
from torch.nn import init

# every initialiser torch's own modules call from reset_parameters
_INITS = ("normal_", "uniform_", "trunc_normal_", "kaiming_uniform_", "kaiming_normal_",
          "xavier_uniform_", "xavier_normal_", "ones_", "zeros_", "constant_", "eye_",
          "orthogonal_")
_lock = threading.RLock()  # (one patch at a time: two threads building models at once)


def _skip(tensor: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
    return tensor


@contextlib.contextmanager
def on_meta() -> Iterator[None]:
    """``with torch.device("meta")``, the initialisers switched off while it lasts."""
    with _lock:
        saved = {name: getattr(init, name) for name in _INITS}
        try:
            for name in _INITS:
                setattr(init, name, _skip)
            with torch.device("meta"):
                yield
        finally:
            for name, fn in saved.items():
                setattr(init, name, fn)


__all__ = ["on_meta"]
