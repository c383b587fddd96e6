"""tcp: across hosts. ZMQ PUSH to the peer's bound PULL; frame 0 is the envelope, each
tensor follows as one raw frame (sent zero-copy, received zero-copy).

Security: binds only where told (default 127.0.0.1). With ``keys`` every socket speaks
CURVE (encrypted, and the receiver admits only allowed client keys via ZAP); the address
then carries the server's public key (``tcp://host:port#curve=<64 hex>``) so a sender
knows whom it talks to. Without keys, binding or sending to anything but loopback is
refused: plaintext never leaves the host.
"""
from __future__ import annotations

import ipaddress
import re
import warnings
from collections.abc import Iterable
from typing import Any

import torch
import zmq
from zmq.utils import z85

from .auth import Keys, ServerAuth, secure_client, secure_server
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

_ADDR = re.compile(r"^tcp://(\[[0-9A-Fa-f:.]+\]|[A-Za-z0-9.-]+):(\d{1,5})(?:#curve=([0-9a-f]{64}))?$")
_WILDCARD = {"0.0.0.0", "*", "::", "[::]"}


def is_loopback(host: str) -> bool:
    host = host.strip("[]")
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _bracket(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


class TcpConnector(ZmqEndpoint):
    kind = "tcp"

    def __init__(self, name: str, header_type: Any, limits: Limits = DEFAULT_LIMITS,
                 send_timeout_ms: int = 5000, bind_host: str = "127.0.0.1", port: int = 0,
                 advertise_host: str | None = None, keys: Keys | None = None,
                 allowed_clients: Iterable[bytes] | None = None,
                 close_linger_ms: int = 1000) -> None:
        if keys is None and not is_loopback(bind_host):
            raise ConnectorError(
                f"refusing to bind tcp on {bind_host}: without CURVE keys the tcp transport "
                "binds loopback only (give keys, see `triptych keys`)")
        if bind_host in _WILDCARD and advertise_host is None:
            raise ConnectorError(f"binding {bind_host} needs advertise_host (the address "
                                 "peers use)")
        self.name = name
        self.keys = keys
        self.close_linger_ms = close_linger_ms
        super().__init__(zmq.Context(), header_type, limits, send_timeout_ms,
                         max_frame_bytes=max(limits.max_message_bytes, limits.max_header_bytes))
        self._pull.setsockopt(zmq.IPV6, 1)
        self._auth: ServerAuth | None = None
        try:
            if keys is not None:
                allowed = keys.peers.values() if allowed_clients is None else allowed_clients
                self._auth = secure_server(self._pull, keys, allowed)
            self._pull.bind(f"tcp://{_bracket(bind_host)}:{port}")
        except BaseException:
            self._close_sockets()
            if self._auth is not None:
                self._auth.close()
            self._ctx.term()
            raise
        bound_port = self._pull.getsockopt_string(zmq.LAST_ENDPOINT).rsplit(":", 1)[1]
        self.address = f"tcp://{_bracket(advertise_host or bind_host)}:{bound_port}"
        if keys is not None:
            self.address += "#curve=" + z85.decode(keys.public).hex()

    # -- sending -----------------------------------------------------------------------
    def _parse(self, peer: str) -> tuple[str, bytes | None]:
        m = _ADDR.match(peer)
        if not m:
            raise ConnectorError(f"not a tcp endpoint address: {peer[:120]!r}")
        host, port, key = m.groups()
        if not 0 < int(port) < 65536:
            raise ConnectorError(f"bad port in {peer!r}")
        if self.keys is None and key is not None:
            raise ConnectorError(f"peer {peer[:60]} requires CURVE; this endpoint has no keys")
        if self.keys is not None and key is None:
            raise ConnectorError(f"peer {peer} carries no server key; refusing plaintext")
        if key is None and not is_loopback(host):
            raise ConnectorError(f"refusing plaintext tcp to {host}: give CURVE keys")
        return f"tcp://{host}:{port}", (z85.encode(bytes.fromhex(key)) if key else None)

    def _connect_address(self, peer: str) -> str:
        return self._parse(peer)[0]

    def _prepare_push(self, sock: zmq.Socket, peer: str) -> None:
        sock.setsockopt(zmq.IPV6, 1)
        # Notice a peer host that vanished without closing (the pipe is then dropped and,
        # with IMMEDIATE, new sends time out instead of queueing for a dead peer).
        sock.setsockopt(zmq.HEARTBEAT_IVL, 1000)
        sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, 5000)
        server_key = self._parse(peer)[1]
        if self.keys is not None and server_key is not None:
            secure_client(sock, self.keys, server_key)

    def _pack(self, peer: str, tensors: list[torch.Tensor]) -> Packed:
        return [spec_of(t) for t in tensors], {}, [host_bytes(t) for t in tensors]

    # -- receiving ---------------------------------------------------------------------
    def _unpack(self, env: Envelope, frames: list[zmq.Frame]) -> list[torch.Tensor]:
        if len(frames) != len(env.tensors):
            raise BadMessage(f"wrong frame count: {len(frames)} frames for "
                             f"{len(env.tensors)} tensors")
        if env.segment is not None or env.ref:
            raise BadMessage("tcp message names a segment or stash entry")
        out = []
        for spec, frame in zip(env.tensors, frames):
            if len(frame) != spec.nbytes:
                raise BadMessage("tensor frame of the wrong size")
            if not spec.nbytes:
                out.append(as_tensor(spec, torch.empty(0, dtype=torch.uint8)))
                continue
            with warnings.catch_warnings():
                # The frame's memory is read-only to Python but private to this message;
                # viewing it avoids a copy (the tensor keeps the frame alive).
                warnings.simplefilter("ignore", UserWarning)
                flat = torch.frombuffer(frame.buffer, dtype=torch.uint8)
            out.append(as_tensor(spec, flat))
        return out

    def _peer_key(self, frame: zmq.Frame) -> str | None:
        if self.keys is None:
            return None
        try:
            return frame.get("User-Id")
        except zmq.ZMQError:
            return None

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        self._close_sockets(self.close_linger_ms)
        if self._auth is not None:
            self._auth.close()
        self._ctx.term()
