"""Count what would be a device -> host synchronisation on a GPU, on the CPU.

On a GPU, a forward pass that reads a device value back stalls the host until the device
has caught up; so does an op whose output size depends on the data (the host must learn
the size to allocate the result), and a copy between host memory that is not pinned and
the device. On the CPU all of these cost nothing and go unnoticed; this counter makes them
visible, inside ``torch.inference_mode()`` as outside it (the engine's forward runs in it):

- reads: ``aten._local_scalar_dense`` and ``aten.item`` (``int(t)``, ``bool(t)``,
  ``float(t)``, ``t.item()``), ``aten.equal`` and ``aten.is_nonzero`` (a bool on the host),
  and ``Tensor.tolist / numpy / cpu / item`` (patched: not all reach the dispatcher), a
  ``Tensor.to`` whose target is the host;
- data-dependent sizes: ``nonzero``, ``argwhere``, ``masked_select``, every ``unique``,
  ``bincount``, ``repeat_interleave`` with tensor repeats and no ``output_size``, indexing
  (``index`` / ``index_put``) with a boolean or uint8 mask;
- pageable copies: ``torch.tensor(data, device=...)`` and ``Tensor.to(device)`` of host
  data (the CPU plays the device here, so a ``.to`` onto the CPU is one of these too):
  on a GPU a copy from pageable memory, which waits. Host data reaches the device through
  engine/device/device_io.py (one staged copy, or pinned + non_blocking), never this way.

Reads from Triton's own interpreter (``TRITON_INTERPRET=1`` copies kernel arguments to
numpy) are not counted: on a GPU the kernel launches without them. Numpy arrays the engine
keeps on the host are never counted either: numpy is the host.
"""
from __future__ import annotations

import os
import traceback
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.utils._python_dispatch import TorchDispatchMode

_aten = torch.ops.aten
# ops that read a device value or size their output by the data, whatever their arguments
_SYNC_OPS = {_aten._local_scalar_dense, _aten.item, _aten.equal, _aten.is_nonzero,
             _aten.nonzero, _aten.argwhere, _aten.masked_select, _aten._unique,
             _aten._unique2, _aten.unique_dim, _aten.unique_consecutive,
             _aten.unique_dim_consecutive, _aten.bincount}
_MASK_DTYPES = (torch.bool, torch.uint8)
_PATCHED = ("tolist", "numpy", "cpu", "item")


def _sync_op(func: Any, args: Any, kwargs: dict) -> str | None:
    """The name to record when ``func(*args, **kwargs)`` would sync a GPU, else None."""
    packet = func.overloadpacket
    if packet in _SYNC_OPS:
        return str(packet)
    if packet is _aten.repeat_interleave and isinstance(args[0] if args else None,
                                                        torch.Tensor):
        repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
        tensor_repeats = isinstance(repeats, torch.Tensor) or (
            len(args) == 1 and args[0].dtype in (torch.int32, torch.int64))
        size = kwargs.get("output_size", args[3] if len(args) > 3 else None)
        if tensor_repeats and size is None:
            return "aten.repeat_interleave (no output_size)"
    if packet in (_aten.index, _aten.index_put, _aten.index_put_, _aten._index_put_impl_):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(isinstance(i, torch.Tensor) and i.dtype in _MASK_DTYPES for i in indices or ()):
            return f"{packet} with a boolean mask"
    return None


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
        kwargs = kwargs or {}
        if not self._inside:
            what = _sync_op(func, args, kwargs)
            if what is not None:
                self.record(what)
        return func(*args, **kwargs)


def _to_host(args: tuple, kwargs: dict) -> bool:
    dev = kwargs.get("device", args[0] if args else None)
    return isinstance(dev, (str, torch.device)) and torch.device(dev).type == "cpu"


@contextmanager
def count_host_syncs() -> Iterator[HostSyncs]:
    """Count device reads inside the block (see the module's docstring)."""
    mode = HostSyncs()
    saved = {name: getattr(torch.Tensor, name) for name in (*_PATCHED, "to")}
    saved_tensor = torch.tensor

    def guarded(orig: Any, what: str, when: Any = None) -> Any:
        def read(*a: Any, **k: Any) -> Any:
            if mode._inside or (when is not None and not when(a[1:], k)):
                return orig(*a, **k)
            mode.record(what)
            mode._inside += 1
            try:
                return orig(*a, **k)
            finally:
                mode._inside -= 1
        return read

    for name in _PATCHED:
        setattr(torch.Tensor, name, guarded(saved[name], f"Tensor.{name}"))
    torch.Tensor.to = guarded(saved["to"], "Tensor.to(device) (pageable)", _to_host)
    torch.tensor = guarded(saved_tensor, "torch.tensor(data, device=...) (pageable)",
                           lambda a, k: k.get("device") is not None)
    try:
        with mode:
            yield mode
    finally:
        for name, fn in saved.items():
            setattr(torch.Tensor, name, fn)
        torch.tensor = saved_tensor


def report(events: list[tuple[str, str]]) -> str:
    return "\n".join(f"  {what} at {where}" for what, where in events) or "  (none)"


__all__ = ["HostSyncs", "count_host_syncs", "report"]
