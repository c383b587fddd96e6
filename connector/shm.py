"""shm: two processes on one host. Each message's tensors are written once into a fresh
/dev/shm segment; only the envelope (header, specs, segment name) goes over a ZMQ ipc://
socket in an owner-only (0700) directory. The receiver maps the segment (copy-on-write,
no copy) and unlinks it at once; see segments.py for who unlinks what, and when.
"""
from __future__ import annotations

import os
import secrets
import shutil
import threading
import time
from typing import Any

import torch
import zmq

from . import segments
from .endpoint import Packed, ZmqEndpoint
from .envelope import (
    DEFAULT_LIMITS,
    BadMessage,
    ConnectorError,
    Envelope,
    Limits,
    as_tensor,
    host_bytes,
    spec_of,
)
from .owner import make_owned_dir, release

_MAX_IPC_PATH = 100  # sun_path holds 108 bytes


class ShmConnector(ZmqEndpoint):
    kind = "shm"

    def __init__(self, name: str, header_type: Any, limits: Limits = DEFAULT_LIMITS,
                 send_timeout_ms: int = 5000, prefix: str = "triptych-",
                 segment_ttl_s: float = 30.0, close_linger_ms: int = 1000,
                 shm_dir: str = segments.SHM_DIR, ipc_dir: str | None = None) -> None:
        self.name = name
        self.prefix = segments.check_prefix(prefix)
        self.segment_ttl_s = segment_ttl_s
        self.close_linger_ms = close_linger_ms
        self._shm_dir = shm_dir
        self._pattern = segments.name_pattern(prefix)
        self._id = secrets.token_hex(4)
        self._ns = segments.pid_namespace()
        # NOTE: the owner pid in the name and the lock in the dir (connector/owner.py) let
        # cleanup_stale remove a dead process's files, and only those.
        self._dir, self._dir_lock = make_owned_dir(f"{prefix}{os.getpid()}-ipc-", ipc_dir)
        path = os.path.join(self._dir, "rx")
        ctx = zmq.Context()
        try:
            if len(path) > _MAX_IPC_PATH:
                raise ConnectorError(f"ipc socket path too long: {path}")
            super().__init__(ctx, header_type, limits, send_timeout_ms,
                             max_frame_bytes=limits.max_header_bytes)
            self.address = f"ipc://{path}"
            self._pull.bind(self.address)
        except BaseException:
            ctx.destroy(linger=0)
            shutil.rmtree(self._dir, ignore_errors=True)
            release(self._dir_lock)
            raise
        self._pending: dict[str, float] = {}  # segments we made and nobody took: deadline
        self._lock = threading.Lock()
        self._stop = threading.Event()
        self._reaper = threading.Thread(target=self._reap_loop, name=f"shm-reaper-{name}",
                                        daemon=True)
        self._reaper.start()

    # -- sending -----------------------------------------------------------------------
    def _connect_address(self, peer: str) -> str:
        if not peer.startswith("ipc:///") or len(peer) > _MAX_IPC_PATH + 6:
            raise ConnectorError(f"not an shm endpoint address: {peer[:120]!r}")
        return peer

    def _pack(self, peer: str, tensors: list[torch.Tensor]) -> Packed:
        if not tensors:
            return [], {}, []
        parts = [host_bytes(t) for t in tensors]
        offsets, size = segments.layout([p.nbytes for p in parts])
        name = (f"{self.prefix}{os.getpid()}-{self._ns}-{self._id}-"
                f"{secrets.token_hex(8)}")  # unguessable (segments.py)
        path = os.path.join(self._shm_dir, name)
        try:
            segments.write_segment(path, parts, offsets, size)
        except OSError as e:
            raise ConnectorError(f"cannot write shared-memory segment ({e.strerror})") from None
        with self._lock:
            self._pending[name] = time.monotonic() + self.segment_ttl_s
        specs = [spec_of(t, off) for t, off in zip(tensors, offsets)]
        return specs, {"segment": name, "segment_size": size}, []

    def _pack_failed(self, peer: str, fields: dict[str, Any]) -> None:
        name = fields.get("segment")
        if name:
            with self._lock:
                self._pending.pop(name, None)
            segments.unlink(os.path.join(self._shm_dir, name))

    def _reap(self, now: float) -> None:
        """Forget segments a receiver took (unlinked); unlink those past their TTL."""
        with self._lock:
            items = list(self._pending.items())
        for name, deadline in items:
            path = os.path.join(self._shm_dir, name)
            if not os.path.exists(path):
                gone = True
            elif now >= deadline:
                gone = segments.unlink(path)
                self.stats.reaped_segments += int(gone)
            else:
                continue
            with self._lock:
                self._pending.pop(name, None)

    def _reap_loop(self) -> None:
        interval = min(1.0, max(0.05, self.segment_ttl_s / 4))
        while not self._stop.wait(interval):
            self._reap(time.monotonic())

    # -- receiving ---------------------------------------------------------------------
    def _segment_path(self, env: Envelope) -> str:
        if env.segment is None or not self._pattern.match(env.segment):
            raise BadMessage("bad shared-memory segment name")
        return os.path.join(self._shm_dir, env.segment)

    def _unpack(self, env: Envelope, frames: list[zmq.Frame]) -> list[torch.Tensor]:
        if frames:
            raise BadMessage("wrong frame count for an shm message")
        if not env.tensors and env.segment is None:
            return []
        path = self._segment_path(env)
        if env.segment_size > self.limits.max_message_bytes + segments.ALIGN * len(env.tensors):
            raise BadMessage("shared-memory segment over the message size limit")
        flats = segments.map_segment(path, env.segment_size, list(env.tensors))
        return [as_tensor(s, f) for s, f in zip(env.tensors, flats)]

    def _discard(self, env: Envelope) -> None:
        # A rejected message's segment is freed now rather than at the sender's TTL; a name
        # outside our pattern is never touched.
        if env.segment is not None and self._pattern.match(env.segment):
            segments.unlink(os.path.join(self._shm_dir, env.segment))

    # -- closing -----------------------------------------------------------------------
    def close(self, linger_ms: int | None = None) -> None:
        """Deliver queued handles and wait for receivers to take our segments for at most
        ``linger_ms`` (default close_linger_ms), then unlink what is left."""
        if self._closed:
            return
        self._closed = True
        linger_ms = self.close_linger_ms if linger_ms is None else linger_ms
        self._stop.set()
        self._reaper.join(timeout=5)
        deadline = time.monotonic() + linger_ms / 1000
        self._close_sockets(linger_ms)
        while self._pending and time.monotonic() < deadline:
            self._reap(time.monotonic())
            time.sleep(0.01)
        self._reap(float("inf"))
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)
        release(self._dir_lock)
