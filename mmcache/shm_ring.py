"""The shared-memory processor cache (``mm_processor_cache_type="shm"``).

P0 writes processed tensors into one ring in a shared-memory segment and keeps the keys;
every reader on the host (all ranks of a worker group, all encode workers) maps the same
segment read-only and copies items out by reference (``ShmItemRef``, a msgspec Struct that
travels in the messages). Nothing in the segment is pickled: a fixed binary header per
entry, then the raw tensor bytes.

Segment:   [global header, 4 KiB][ring of entries .................................]
Entry:     [header 128 B: magic, seq, key digest, dtype, shape, nbytes][payload][pad to 64]

Eviction is in ring order: the writer's head runs over the oldest entries. An entry P0
pinned for an in-flight request is never run over; if the head would, the new item goes
inline instead (``put`` returns None), as does an item larger than the ring.

Torn reads (seqlock): the writer zeroes an entry's header *before* it writes anything over
the entry and writes a new entry's header (with a fresh sequence number) *after* its
payload. A reader checks the header against the ref before the copy and compares the header
bytes again after it; a change means the entry was overwritten during the copy
(``ShmEntryOverwritten``, a ``ProcessorCacheMiss``: P0 sends the pixels again).
NOTE: this relies on stores becoming visible in program order (x86-64 TSO; the Python
calls between header and payload writes are not reordered by the compiler).
"""
from __future__ import annotations

import hashlib
import itertools
import math
import struct
import threading
import time
import weakref
from collections import deque
from dataclasses import dataclass

import msgspec
import numpy as np
import torch

from triptych.mmcache.lru import ProcessorCacheMiss
from triptych.mmcache.shm_segment import (SHM_DIR, cleanup_stale_segments, create_segment,
                                          open_segment, unlink_segment)

_GLOBAL = struct.Struct("<8sIIQQ")  # magic, version, entry header size, data offset, capacity
_MAGIC, _VERSION = b"TRPTRING", 1
_DATA_OFFSET = 4096
_ENTRY = struct.Struct("<4sIQ32sBB2xI4QQ")  # magic, 0, seq, digest, dtype, ndim, 0, shape, nbytes
_ENTRY_MAGIC = b"TRPE"
_HDR = 128  # entry header bytes (struct padded up)
_ALIGN = 64
_DTYPES = {1: torch.float32, 2: torch.float16, 3: torch.bfloat16}
_CODES = {v: k for k, v in _DTYPES.items()}
_NAMES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
MAX_NDIM = 4


class ShmItemRef(msgspec.Struct, frozen=True):
    """Where one item lies in the ring; travels in a message with the item's mm hash."""

    offset: int  # entry start, relative to the ring
    seq: int  # sequence number the entry was written with (0 is never used)
    dtype: str  # "float32" | "float16" | "bfloat16"
    shape: list[int]  # tensor shape, at most 4 dims
    # "": P0's ring; else a segment of its own in the same format (a preparation process's
    # items, api/prep_pool.py: ``write_items`` / ``read_item``)
    segment: str = ""


class ShmEntryOverwritten(ProcessorCacheMiss):
    """The entry a ref names is gone (run over by the ring); P0 must send the pixels."""


def _digest(key: str) -> bytes:
    return hashlib.blake2b(key.encode(), digest_size=32).digest()


def _align(n: int) -> int:
    return (n + _ALIGN - 1) // _ALIGN * _ALIGN


@dataclass
class _Entry:
    key: str
    offset: int  # relative to the ring
    length: int  # header + payload, aligned
    ref: ShmItemRef


class ShmRingWriter:
    """P0's side: one segment, the keys, the ring head and the pins. Thread-safe."""

    def __init__(self, capacity_bytes: int, *, shm_dir: str = SHM_DIR,
                 pin_lease_s: float = 600.0, cleanup_stale: bool = True) -> None:
        if capacity_bytes < _ALIGN:
            raise ValueError("a shm processor cache needs at least 64 bytes")
        if cleanup_stale:
            cleanup_stale_segments(shm_dir)
        self.capacity_bytes = capacity_bytes // _ALIGN * _ALIGN
        self.shm_dir, self.pin_lease_s = shm_dir, pin_lease_s
        self.name, self._mm = create_segment(_DATA_OFFSET + self.capacity_bytes, shm_dir)
        self._mm[:_GLOBAL.size] = _GLOBAL.pack(_MAGIC, _VERSION, _HDR, _DATA_OFFSET,
                                               self.capacity_bytes)
        # NOTE: unlinked on close(), on garbage collection and at interpreter exit; after
        # kill -9 the next writer's cleanup_stale_segments() removes it.
        self._finalizer = weakref.finalize(self, unlink_segment, self.name, shm_dir)
        self._lock = threading.Lock()
        self._ring: deque[_Entry] = deque()  # live entries, oldest first
        self._by_key: dict[str, _Entry] = {}
        self._pins: dict[str, tuple[int, float]] = {}  # key -> (count, lease deadline)
        self._head = 0
        self._seq = 0
        self.num_bytes = 0  # bytes of live entries (headers and padding included)
        self.num_inline = 0  # puts refused: larger than the ring, or a pinned entry in the way
        self.num_evicted = 0

    def __len__(self) -> int:
        return len(self._by_key)

    def __contains__(self, key: str) -> bool:
        return key in self._by_key

    def get(self, key: str, pin: bool = False) -> ShmItemRef | None:
        """The ref of a live entry (pinned if asked, under the same lock), or None."""
        with self._lock:
            e = self._by_key.get(key)
            if e is not None and pin:
                self._pin(key)
            return e.ref if e is not None else None

    def put(self, key: str, tensor: torch.Tensor, pin: bool = False) -> ShmItemRef | None:
        """Write ``tensor`` under ``key`` (or return the live entry); None means: send it
        inline (larger than the ring, or a pinned entry is in the head's way)."""
        t = tensor.detach().contiguous().cpu()
        if t.dtype not in _CODES or not 1 <= t.dim() <= MAX_NDIM:
            raise ValueError(f"cannot put a {t.dtype} tensor of {t.dim()} dims in the ring")
        nbytes = t.numel() * t.element_size()
        need = _align(_HDR + nbytes)
        with self._lock:
            e = self._by_key.get(key)
            if e is not None:
                if pin:
                    self._pin(key)
                return e.ref
            spot = self._reserve(need) if need <= self.capacity_bytes else None
            if spot is None:
                self.num_inline += 1
                return None
            pos, victims = spot
            mm, base = self._mm, _DATA_OFFSET + pos
            for v in victims:  # headers first: readers of these entries must notice
                mm[_DATA_OFFSET + v.offset:_DATA_OFFSET + v.offset + _HDR] = bytes(_HDR)
                self._ring.popleft()
                del self._by_key[v.key]
                self._pins.pop(v.key, None)  # only expired pins can be here
                self.num_bytes -= v.length
                self.num_evicted += 1
            mm[base + _HDR:base + _HDR + nbytes] = t.view(-1).view(torch.uint8).numpy()
            self._seq += 1
            shape = list(t.shape)
            mm[base:base + _ENTRY.size] = _ENTRY.pack(
                _ENTRY_MAGIC, 0, self._seq, _digest(key), _CODES[t.dtype], len(shape), 0,
                *(shape + [0] * (MAX_NDIM - len(shape))), nbytes)
            ref = ShmItemRef(pos, self._seq, str(t.dtype).removeprefix("torch."), shape)
            e = _Entry(key, pos, need, ref)
            self._ring.append(e)
            self._by_key[key] = e
            self.num_bytes += need
            self._head = pos + need
            if pin:
                self._pin(key)
            return ref

    def _reserve(self, need: int) -> tuple[int, list[_Entry]] | None:
        """Where the next entry goes and the (oldest) entries it runs over; None if a
        pinned entry is among them."""
        wrap = self._head + need > self.capacity_bytes
        pos = 0 if wrap else self._head
        victims: list[_Entry] = []
        now = time.monotonic()
        # Oldest first: the entries right after the head; on a wrap, first those in the
        # skipped tail, then those at the start of the ring.
        for e in self._ring:
            in_tail = wrap and e.offset >= self._head
            overlaps = e.offset < pos + need and e.offset + e.length > pos
            if not (in_tail or overlaps):
                break
            if self._is_pinned(e.key, now):
                return None
            victims.append(e)
        return pos, victims

    # -- pins: an in-flight request's entries must survive until its worker read them --
    def _pin(self, key: str) -> None:
        count, _ = self._pins.get(key, (0, 0.0))
        self._pins[key] = (count + 1, time.monotonic() + self.pin_lease_s)

    def _is_pinned(self, key: str, now: float) -> bool:
        count, deadline = self._pins.get(key, (0, 0.0))
        return count > 0 and deadline > now  # an expired lease no longer holds the ring

    def pin(self, key: str) -> bool:
        """Pin a live entry; False if ``key`` is not in the ring."""
        with self._lock:
            if key not in self._by_key:
                return False
            self._pin(key)
            return True

    def unpin(self, key: str) -> None:
        with self._lock:
            count, deadline = self._pins.get(key, (0, 0.0))
            if count <= 1:
                self._pins.pop(key, None)
            else:
                self._pins[key] = (count - 1, deadline)

    def close(self) -> None:
        """Unmap and unlink; readers keep their mappings until they close them."""
        with self._lock:
            if not self._mm.closed:
                self._mm.close()
            self._finalizer()

    def check_integrity(self) -> None:
        with self._lock:
            assert len(self._ring) == len(self._by_key)
            assert self.num_bytes == sum(e.length for e in self._ring) <= self.capacity_bytes
            spans = sorted((e.offset, e.offset + e.length) for e in self._ring)
            assert all(a[1] <= b[0] for a, b in itertools.pairwise(spans)), "entries overlap"
            assert all(s[1] <= self.capacity_bytes for s in spans)


def write_items(items: list[tuple[str, torch.Tensor]], *, shm_dir: str = SHM_DIR
                ) -> tuple[str, list[ShmItemRef]]:
    """A new segment in the ring's format holding exactly ``items`` ((key, tensor), in
    order): a preparation process's result, read by workers like ring entries
    (``read_item``). The segment outlives this call: its owner unlinks it."""
    sizes = [_align(_HDR + t.numel() * t.element_size()) for _, t in items]
    writer = ShmRingWriter(max(_ALIGN, sum(sizes)), shm_dir=shm_dir, cleanup_stale=False)
    try:
        refs = []
        for key, tensor in items:
            ref = writer.put(key, tensor)
            assert ref is not None, "a segment sized for its items holds them"
            refs.append(msgspec.structs.replace(ref, segment=writer.name))
        writer._finalizer.detach()  # NOTE: the segment is handed over, not removed
        return writer.name, refs
    except BaseException:
        writer.close()
        raise
    finally:
        if not writer._mm.closed:
            writer._mm.close()


def read_item(ref: ShmItemRef, key: str, *, shm_dir: str = SHM_DIR,
              max_item_bytes: int = 1 << 30) -> torch.Tensor:
    """A copy of item ``key`` from the segment its ref names (``write_items``): checked as
    a ring entry is. A segment that is gone raises ``ShmEntryOverwritten`` (P0 sends the
    pixels again); ValueError for a malformed ref."""
    try:
        reader = ShmRingReader(ref.segment, shm_dir=shm_dir, max_item_bytes=max_item_bytes)
    except FileNotFoundError:
        raise ShmEntryOverwritten([key]) from None
    try:
        return reader.read(ref, key)
    finally:
        reader.close()


class ShmRingReader:
    """A worker's read-only view of the ring. Copies items out after validating them."""

    def __init__(self, name: str, *, shm_dir: str = SHM_DIR, max_item_bytes: int = 1 << 30
                 ) -> None:
        self._mm = open_segment(name, shm_dir)
        self.max_item_bytes = max_item_bytes
        magic, version, hdr, data_offset, capacity = _GLOBAL.unpack_from(self._mm, 0)
        if (magic, version, hdr, data_offset) != (_MAGIC, _VERSION, _HDR, _DATA_OFFSET) or \
                data_offset + capacity != len(self._mm):
            self._mm.close()
            raise ValueError("not a triptych processor-cache ring")
        self.capacity_bytes = capacity

    def read(self, ref: ShmItemRef, key: str) -> torch.Tensor:
        """A copy of the item ``key`` the ref points at; ``ShmEntryOverwritten`` if it is no
        longer there (or was run over during the copy); ValueError for a malformed ref."""
        dtype = _NAMES.get(ref.dtype)
        if dtype is None:
            raise ValueError(f"unsupported tensor dtype {ref.dtype!r}")
        shape = ref.shape
        if not 1 <= len(shape) <= MAX_NDIM or any(type(s) is not int or s < 0 for s in shape):
            raise ValueError("bad tensor shape")
        nbytes = math.prod(shape) * torch.tensor([], dtype=dtype).element_size()
        if type(ref.offset) is not int or ref.offset < 0 or ref.offset % _ALIGN or \
                nbytes > self.max_item_bytes or \
                ref.offset + _HDR + nbytes > self.capacity_bytes or ref.seq <= 0:
            raise ValueError("shm ref points outside the ring")
        base = _DATA_OFFSET + ref.offset
        want = _ENTRY.pack(_ENTRY_MAGIC, 0, ref.seq, _digest(key), _CODES[dtype], len(shape), 0,
                           *(shape + [0] * (MAX_NDIM - len(shape))), nbytes)
        if self._header(base) != want:
            raise ShmEntryOverwritten([key])
        data = self._copy(base + _HDR, nbytes)
        if self._header(base) != want:  # seqlock: the writer touched it during the copy
            raise ShmEntryOverwritten([key])
        return torch.from_numpy(data).view(dtype).view(shape)

    def _header(self, base: int) -> bytes:
        return self._mm[base:base + _ENTRY.size]

    def _copy(self, start: int, nbytes: int) -> np.ndarray:
        return np.frombuffer(self._mm, dtype=np.uint8, count=nbytes, offset=start).copy()

    def close(self) -> None:
        if not self._mm.closed:
            self._mm.close()
