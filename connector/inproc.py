"""inproc: sender and receiver in one process (colocated layout, encoder inside the
prefill worker, tests). Tensors are passed by reference, never copied.

The sender parks the tensor list in the receiving endpoint's stash under a fresh key and
sends only the envelope (header + specs + key) over a ZMQ inproc:// socket, so the
receiver's ``poll_socket`` wakes a worker loop exactly like the other transports do.
"""
from __future__ import annotations

import itertools
import re
import threading
from typing import Any

import torch
import zmq

from .endpoint import Packed, ZmqEndpoint
from .envelope import DEFAULT_LIMITS, BadMessage, ConnectorError, Envelope, Limits, spec_of

_PREFIX = "inproc://triptych-"
_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
_ENDPOINTS: dict[str, InprocConnector] = {}  # address -> live endpoint of this process
_LOCK = threading.Lock()
_CTX: zmq.Context | None = None


def _context() -> zmq.Context:
    # NOTE: inproc:// only joins sockets of one context, so every inproc endpoint of the
    # process shares this one. It is never terminated (it owns no files or ports).
    global _CTX
    with _LOCK:
        if _CTX is None:
            _CTX = zmq.Context()
        return _CTX


class InprocConnector(ZmqEndpoint):
    kind = "inproc"

    def __init__(self, name: str, header_type: Any, limits: Limits = DEFAULT_LIMITS,
                 send_timeout_ms: int = 5000, max_stash: int = 1024) -> None:
        if not _NAME.match(name):
            raise ConnectorError(f"bad inproc endpoint name {name!r}")
        super().__init__(_context(), header_type, limits, send_timeout_ms,
                         max_frame_bytes=limits.max_header_bytes)
        self.name = name
        self.address = _PREFIX + name
        self._stash: dict[int, list[torch.Tensor]] = {}
        self._stash_lock = threading.Lock()
        self._max_stash = max_stash
        self._keys = itertools.count(1)
        with _LOCK:
            if self.address in _ENDPOINTS:
                self._pull.close(0)
                raise ConnectorError(f"inproc endpoint {name!r} already exists")
            _ENDPOINTS[self.address] = self
        self._pull.bind(self.address)

    # -- the receiving side's stash (called by senders, possibly from other threads) ----
    def _put(self, tensors: list[torch.Tensor]) -> int:
        with self._stash_lock:
            if self._closed:
                raise ConnectorError(f"inproc endpoint {self.name!r} is closed")
            if len(self._stash) >= self._max_stash:
                raise ConnectorError(f"inproc endpoint {self.name!r} has "
                                     f"{self._max_stash} unread messages")
            key = next(self._keys)
            self._stash[key] = tensors
            return key

    def _take(self, key: int) -> list[torch.Tensor] | None:
        with self._stash_lock:
            return self._stash.pop(key, None)

    # -- transport hooks ---------------------------------------------------------------
    def _target(self, peer: str) -> InprocConnector:
        with _LOCK:
            target = _ENDPOINTS.get(peer)
        if target is None:
            raise ConnectorError(f"no inproc endpoint at {peer!r} in this process")
        return target

    def _connect_address(self, peer: str) -> str:
        return self._target(peer).address

    def _pack(self, peer: str, tensors: list[torch.Tensor]) -> Packed:
        specs = [spec_of(t) for t in tensors]
        if not tensors:
            return specs, {}, []
        return specs, {"ref": self._target(peer)._put(tensors)}, []

    def _pack_failed(self, peer: str, fields: dict[str, Any]) -> None:
        if fields.get("ref"):
            with _LOCK:
                target = _ENDPOINTS.get(peer)
            if target is not None:
                target._take(fields["ref"])

    def _unpack(self, env: Envelope, frames: list[zmq.Frame]) -> list[torch.Tensor]:
        if frames:
            raise BadMessage("wrong frame count for an inproc message")
        if not env.tensors:
            return []
        tensors = self._take(env.ref)
        if tensors is None:
            raise BadMessage("inproc message refers to no stashed tensors")
        if [spec_of(t) for t in tensors] != list(env.tensors):
            raise BadMessage("stashed tensors do not match their specs")
        return tensors

    def _discard(self, env: Envelope) -> None:
        if env.ref:
            self._take(env.ref)

    def close(self) -> None:
        if self._closed:
            return
        with _LOCK, self._stash_lock:
            self._closed = True
            _ENDPOINTS.pop(self.address, None)
            self._stash.clear()
        self._close_sockets()
