"""Count what would be a device -> host synchronisation on a GPU, on the CPU.

On a GPU, a forward pass that reads a device value back (``int(t.max())``, ``.item()``,
``.tolist()``, ``.cpu()``, ``.numpy()``, a ``nonzero`` whose size depends on the data)
stalls the host until the device has caught up. On the CPU those reads cost nothing, so
they go unnoticed; this counter makes them visible:

- a ``TorchDispatchMode`` records ``aten._local_scalar_dense`` (``item``, ``int(t)``,
  ``bool(t)``) and ``aten.nonzero``;
- ``Tensor.tolist``, ``Tensor.numpy``, ``Tensor.cpu`` and ``Tensor.item`` are patched
  (they do not all go through the dispatcher).

Reads from Triton's own interpreter (``TRITON_INTERPRET=1`` copies kernel arguments to
numpy) are not counted: on a GPU the kernel launches without them. Host arrays the engine
keeps as numpy are never counted either: numpy is the host.
"""
from __future__ import annotations

import os
import traceback
from contextlib import contextmanager
from typing import Any, Iterator

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
_SYNC_OPS = {_aten._local_scalar_dense, _aten.nonzero}
_PATCHED = ("tolist", "numpy", "cpu", "item")


def _triton_dir() -> str | None:
    try:
        import triton
    except ImportError:
        return None
    return os.path.dirname(triton.__file__)


class HostSyncs(TorchDispatchMode):
    """Records every device read while active: ``events`` holds (what, where) pairs."""

    def __init__(self) -> None:
        super().__init__()
        self.events: list[tuple[str, str]] = []
        self._skip = _triton_dir()
        self._inside = 0  # a patched method's own dispatch is not counted twice

    def _where(self) -> str | None:
        """The first frame outside this module and torch; None when Triton's interpreter
        asked (not a read on a GPU)."""
        frames = traceback.extract_stack()[:-3]
        if self._skip and any(f.filename.startswith(self._skip) for f in frames):
            return None
        for f in reversed(frames):
            if f.filename != __file__ and f"{os.sep}torch{os.sep}" not in f.filename:
                return f"{f.filename}:{f.lineno} {f.line}"
        return "?"

    def record(self, what: str) -> None:
        where = self._where()
        if where is not None:
            self.events.append((what, where))

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None
                           ) -> Any:
        if func.overloadpacket in _SYNC_OPS and not self._inside:
            self.record(str(func.overloadpacket))
        return func(*args, **(kwargs or {}))


@contextmanager
def count_host_syncs() -> Iterator[HostSyncs]:
    """Count device reads inside the block (see the module's docstring)."""
    mode = HostSyncs()
    saved = {name: getattr(torch.Tensor, name) for name in _PATCHED}

    def patched(name: str) -> Any:
        orig = saved[name]

        def read(self: torch.Tensor, *a: Any, **k: Any) -> Any:
            if mode._inside:
                return orig(self, *a, **k)
            mode.record(f"Tensor.{name}")
            mode._inside += 1
            try:
                return orig(self, *a, **k)
            finally:
                mode._inside -= 1
        return read

    for name in _PATCHED:
        setattr(torch.Tensor, name, patched(name))
    try:
        with mode:
            yield mode
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)


def report(events: list[tuple[str, str]]) -> str:
    return "\n".join(f"  {what} at {where}" for what, where in events) or "  (none)"


__all__ = ["HostSyncs", "count_host_syncs", "report"]

