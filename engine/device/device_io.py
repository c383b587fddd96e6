"""Host <-> device traffic of a step: what crosses, and how, in one place.

On a GPU every host -> device copy goes through pinned memory with ``non_blocking=True``
(the host never waits for it), and a device -> host copy lands in a pinned buffer whose
readiness an event tells: the host waits for exactly the data it reads, never for a
whole device. On the CPU "the device" is the host: nothing is copied at all.

    to_device(t, device)        one host tensor to the device, pinned + non_blocking
    to_host(t)                  one device tensor to a pinned host tensor, non_blocking
                                copy, one event wait (KV export)
    StepStaging.stage(arrays)   a step's host arrays packed into ONE pinned buffer, ONE
                                copy; returns their device views (runner inputs, sampler
                                tensors)
    HostFetch.fetch(tensors)    device results packed on the device, ONE copy into a pinned
                                buffer, one event wait; returns numpy arrays (start + wait:
                                the copy enqueued now, read later)
"""
from __future__ import annotations

import ctypes
import time
from typing import Any

import numpy as np
import torch

ALIGN = 16  # bytes: every staged array starts on a 16-byte boundary (any dtype's alignment)


def is_host(device: torch.device) -> bool:
    return device.type == "cpu"


def to_device(t: torch.Tensor, device: torch.device) -> torch.Tensor:
    """``t`` (on the host) on ``device``: itself on the CPU, else through pinned memory
    without blocking the host (the caching host allocator keeps the pinned copy alive
    until the transfer is done)."""
    if is_host(device) or t.device == device:
        return t
    if t.device.type == "cpu" and not t.is_pinned():
        t = t.pin_memory()
    return t.to(device, non_blocking=True)


def to_host(t: torch.Tensor) -> torch.Tensor:
    """``t`` on the host: itself on the CPU; from a GPU into pinned memory (torch's caching
    host allocator reuses it once the caller drops it) with a non-blocking copy, then a
    wait on that copy's event alone: never a pageable copy, which stalls the whole
    stream's host side."""
    if t.device.type == "cpu":
        return t
    out = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
    out.copy_(t, non_blocking=True)
    done = torch.cuda.Event()
    done.record()
    done.synchronize()
    return out


def _aligned(n: int) -> int:
    return -(-n // ALIGN) * ALIGN


class _Buffers:
    """A host byte buffer and its device twin (one and the same on the host), grown by
    doubling. The host side is pinned when the device is not the host."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.host = torch.empty(0, dtype=torch.uint8)
        self.dev = self.host
        self.host_np = np.empty(0, dtype=np.uint8)  # the host buffer's bytes, as numpy

    def reserve(self, nbytes: int) -> None:
        if nbytes <= self.host.numel():
            return
        n = max(nbytes, 2 * self.host.numel(), 1 << 12)
        if is_host(self.device):
            self.host = self.dev = torch.empty(n, dtype=torch.uint8)
        else:
            self.host = torch.empty(n, dtype=torch.uint8, pin_memory=True)
            self.dev = torch.empty(n, dtype=torch.uint8, device=self.device)
        # NOTE: a view of host memory made once, by address (the host buffer is host memory,
        # pinned or not: reading it is never a device read; tests/host_syncs.py counts
        # Tensor.numpy as one)
        self.host_np = np.ctypeslib.as_array(
            (ctypes.c_uint8 * n).from_address(self.host.data_ptr()))


def _layout(nbytes: list[int]) -> tuple[list[int], int]:
    offsets, end = [], 0
    for n in nbytes:
        offsets.append(end)
        end = _aligned(end + n)
    return offsets, end


class StepStaging:
    """One step's host arrays -> device tensors with one host-to-device copy.

    The arrays are laid out back to back (16-byte aligned) in a pinned byte buffer and
    copied in one ``copy_`` to its device twin; each array comes back as a typed view of
    the device buffer. The buffers grow (doubling) when a step needs more. On the CPU the
    arrays are used where they are (``pack`` True packs them anyway: tests of the layout).

    NOTE: two pinned buffers take turns, and each is reused only after its previous copy
    has left it (an event recorded after that copy): the copy from two stages ago, long
    done, even with the next step staged while this one runs (async scheduling).
    """

    def __init__(self, device: torch.device, pack: bool | None = None) -> None:
        self.device = device
        self.pack = not is_host(device) if pack is None else pack
        self.bufs = [_Buffers(device), _Buffers(device)]
        self._copied: list[torch.cuda.Event | None] = [None, None]
        self._turn = 0
        self.num_copies = 0  # host -> device copies made (tests and the GPU check count)

    def stage(self, arrays: list[np.ndarray | torch.Tensor]) -> list[torch.Tensor]:
        """Device tensors of ``arrays`` (same dtypes and shapes), in order. Host torch
        tensors are taken as bytes (any dtype: bf16 KV blocks too)."""
        if not self.pack:  # the CPU reads the host arrays where they are
            return [a if isinstance(a, torch.Tensor) else
                    torch.from_numpy(np.ascontiguousarray(a)) for a in arrays]
        # (``held`` keeps every contiguous copy alive while its bytes are read by address)
        held = [a.detach().contiguous() if isinstance(a, torch.Tensor) else a for a in arrays]
        raw = [_bytes(a) for a in held]
        offsets, end = _layout([r.nbytes for r in raw])
        i, self._turn = self._turn, self._turn ^ 1
        done = self._copied[i]
        if done is not None:
            done.synchronize()  # this buffer's previous copy has left it
        buf = self.bufs[i]
        buf.reserve(end)
        host = buf.host_np
        for r, off in zip(raw, offsets):
            host[off:off + r.nbytes] = r
        if end and not is_host(self.device):
            buf.dev[:end].copy_(buf.host[:end], non_blocking=True)
            self.num_copies += 1
            self._copied[i] = torch.cuda.Event()
            self._copied[i].record()
        return [buf.dev[off:off + r.nbytes].view(_dtype(a)).view(a.shape)
                for a, r, off in zip(arrays, raw, offsets)]


def _bytes(a: np.ndarray | torch.Tensor) -> np.ndarray:
    """The bytes of a host array or a contiguous host tensor, flat, as numpy uint8 (no
    copy; a tensor's by address, like the buffers': the caller keeps it alive)."""
    if isinstance(a, torch.Tensor):
        assert a.is_contiguous()
        n = a.numel() * a.element_size()
        return np.ctypeslib.as_array((ctypes.c_uint8 * n).from_address(a.data_ptr())) \
            if n else np.empty(0, dtype=np.uint8)
    return np.ascontiguousarray(a).reshape(-1).view(np.uint8)


def _dtype(a: np.ndarray | torch.Tensor) -> torch.dtype:
    return a.dtype if isinstance(a, torch.Tensor) else _TORCH_DTYPES[np.dtype(a.dtype)]


class Fetching:
    """A device -> host copy under way (``HostFetch.start``): read it with ``HostFetch.wait``."""

    def __init__(self, buf: _Buffers, event: torch.cuda.Event | None, tensors: list[Any],
                 offsets: list[int], sizes: list[int]) -> None:
        self.buf, self.event = buf, event
        self.specs = [(t.dtype, tuple(t.shape)) for t in tensors]
        self.offsets, self.sizes = offsets, sizes
        self.waited = False


class HostFetch:
    """Device tensors -> numpy with one device-to-host copy and one event wait.

    The tensors (any dtypes) are packed into one device byte buffer (one small copy each,
    on the device), copied in one ``copy_`` into a pinned host buffer, and read after the
    copy's event: the host waits for these bytes only. The CPU packs them too (one read
    of one buffer: the same code path, minus the copy).

    ``start`` enqueues the copy and returns at once; ``wait`` blocks for it and reads it.
    Each copy lands in a buffer no unread copy uses, so step N+1's copy can be enqueued
    before step N's is read (async scheduling keeps one step in flight); ``fetch`` is both
    at once.
    """

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.bufs = [_Buffers(device), _Buffers(device)]
        self._open: list[Fetching | None] = [None, None]
        self.num_copies = 0  # device -> host copies made (tests and the GPU check count)
        self.wait_seconds = 0.0  # time the host spent blocked in ``wait``

    def start(self, tensors: list[torch.Tensor]) -> Fetching:
        sizes = [t.numel() * t.element_size() for t in tensors]
        offsets, end = _layout(sizes)
        # a buffer no unread copy lands in (two suffice for one step in flight; a step
        # that also reads prompt logprobs takes a third)
        i = next((i for i, f in enumerate(self._open) if f is None or f.waited), None)
        if i is None:
            i = len(self.bufs)
            self.bufs.append(_Buffers(self.device))
            self._open.append(None)
        buf = self.bufs[i]
        buf.reserve(end)
        for t, off, nb in zip(tensors, offsets, sizes):
            if nb:
                buf.dev[off:off + nb].view(t.dtype).copy_(t.reshape(-1))
        event = None
        if not is_host(self.device):
            buf.host[:end].copy_(buf.dev[:end], non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            self.num_copies += 1
        f = self._open[i] = Fetching(buf, event, tensors, offsets, sizes)
        return f

    def wait(self, f: Fetching) -> list[np.ndarray]:
        """The host copies of ``start``'s tensors (blocks until its copy has landed)."""
        if f.event is not None:
            t0 = time.perf_counter()
            f.event.synchronize()
            self.wait_seconds += time.perf_counter() - t0
        f.waited = True
        host = f.buf.host_np
        return [host[off:off + nb].view(_NUMPY_DTYPES[dt]).reshape(shape).copy()
                for (dt, shape), off, nb in zip(f.specs, f.offsets, f.sizes)]

    def fetch(self, tensors: list[torch.Tensor]) -> list[np.ndarray]:
        return self.wait(self.start(tensors))


_TORCH_DTYPES = {np.dtype(np.int64): torch.int64, np.dtype(np.int32): torch.int32,
                 np.dtype(np.float32): torch.float32, np.dtype(np.bool_): torch.bool,
                 np.dtype(np.uint8): torch.uint8}
_NUMPY_DTYPES = {v: k for k, v in _TORCH_DTYPES.items()}
