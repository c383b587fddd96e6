"""The ZMQ plumbing the three transports share: one bound PULL socket to receive, one
PUSH socket per peer to send, bounded reads, envelope checks, stats.

A transport subclass says how tensors travel (``_pack`` / ``_unpack``), what to do with a
message it will not deliver (``_discard``), and how peer addresses are checked and
secured (``_connect_address`` / ``_prepare_push``).
"""
from __future__ import annotations

import threading
import time
from abc import abstractmethod
from collections import OrderedDict
from collections.abc import Sequence
from typing import Any

import msgspec
import torch
import zmq

from .base import Connector, ConnectorStats, Received, elapsed_since
from .envelope import (
    ENCODER,
    ENVELOPE_DECODER,
    BadMessage,
    ConnectorError,
    Envelope,
    Limits,
    SendTimeout,
    TensorSpec,
    check_specs,
    spec_of,
)

# (tensor specs, envelope fields beyond the common ones, data frames after frame 0)
Packed = tuple[list[TensorSpec], dict[str, Any], list[Any]]


class ZmqEndpoint(Connector):
    def __init__(self, ctx: zmq.Context, header_type: Any, limits: Limits,
                 send_timeout_ms: int, max_frame_bytes: int, max_peers: int = 64) -> None:
        self.stats = ConnectorStats()
        self.limits = limits
        self.send_timeout_ms = send_timeout_ms
        self._ctx = ctx
        self._header_decoder = msgspec.msgpack.Decoder(header_type)
        self._peers: OrderedDict[str, zmq.Socket] = OrderedDict()
        self._max_peers = max_peers
        # NOTE: several threads may send (a prefill worker's KV send lanes, one per peer):
        # the peer table is shared; each peer's socket is used by one thread only.
        self._peers_lock = threading.Lock()
        self._closed = False
        self._pull = ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._pull.setsockopt(zmq.RCVHWM, 64)
        # NOTE: ZMQ drops (and disconnects the sender of) any frame over this bound before
        # it reaches us, so a peer cannot make us buffer one huge frame.
        self._pull.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)

    # -- transport hooks ---------------------------------------------------------------
    @abstractmethod
    def _connect_address(self, peer: str) -> str:
        """Check a peer address for this transport; return what ZMQ connects to."""

    def _prepare_push(self, sock: zmq.Socket, peer: str) -> None:
        """Set transport options (CURVE, heartbeats) on a new PUSH socket before connect."""

    @abstractmethod
    def _pack(self, peer: str, tensors: list[torch.Tensor]) -> Packed:
        """Place the tensors for travel; return their specs, envelope fields, frames."""

    def _pack_failed(self, peer: str, fields: dict[str, Any]) -> None:
        """Undo _pack when the message could not be sent (free a segment or stash entry)."""

    @abstractmethod
    def _unpack(self, env: Envelope, frames: list[zmq.Frame]) -> list[torch.Tensor]:
        """Turn a checked envelope and its data frames into tensors (raise BadMessage)."""

    def _discard(self, env: Envelope) -> None:
        """Release whatever a rejected message referenced (a segment, a stash entry)."""

    def _peer_key(self, frame: zmq.Frame) -> str | None:
        return None

    # -- sending -----------------------------------------------------------------------
    def _push_socket(self, peer: str) -> zmq.Socket:
        with self._peers_lock:
            return self._push_socket_locked(peer)

    def _push_socket_locked(self, peer: str) -> zmq.Socket:
        sock = self._peers.get(peer)
        if sock is not None:
            self._peers.move_to_end(peer)
            return sock
        target = self._connect_address(peer)
        sock = self._ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, 16)
        # NOTE: queue only on completed connections (handshake, CURVE included), so a
        # message to an absent or refusing peer times out instead of waiting in memory.
        sock.setsockopt(zmq.IMMEDIATE, 1)
        # NOTE: pyzmq copies frames under copy_threshold and hands back an already-finished
        # tracker for them; send_multipart returns the *last* frame's tracker, so a small
        # last tensor would end send()'s wait while big ones are still being read.
        sock.copy_threshold = 0
        self._prepare_push(sock, peer)
        sock.connect(target)
        self._peers[peer] = sock
        while len(self._peers) > self._max_peers:
            self._peers.popitem(last=False)[1].close(0)
        return sock

    def forget(self, peer: str) -> None:
        """Drop the socket to a peer (e.g. a worker that died); queued messages are lost."""
        with self._peers_lock:
            sock = self._peers.pop(peer, None)
        if sock is not None:
            sock.close(0)

    def send(self, peer: str, header: msgspec.Struct, tensors: Sequence[torch.Tensor] = (),
             timeout_ms: int | None = None) -> int:
        if self._closed:
            raise ConnectorError("connector is closed")
        t0, sent_at = time.perf_counter(), time.time()
        timeout_s = (self.send_timeout_ms if timeout_ms is None else timeout_ms) / 1000
        tensors = list(tensors)
        try:  # the receiver's bounds, checked here too so a sender learns early
            total = check_specs([spec_of(t) for t in tensors], self.limits)
        except BadMessage as e:
            raise ConnectorError(str(e)) from None
        header_bytes = ENCODER.encode(header)
        sock = self._push_socket(peer)
        specs, fields, frames = self._pack(peer, tensors)
        try:
            env = ENCODER.encode(Envelope(msgspec.Raw(header_bytes), specs, sent_at, **fields))
            if len(env) > self.limits.max_header_bytes:
                raise ConnectorError(f"header over {self.limits.max_header_bytes} bytes")
            left_ms = max(1, int((timeout_s - (time.perf_counter() - t0)) * 1000))
            sock.setsockopt(zmq.SNDTIMEO, left_ms)
            try:
                # Only frames that point into the caller's tensors are sent zero-copy and
                # tracked. (An inproc message is released only when the receiver reads it:
                # tracking the envelope there would make send wait for recv.)
                tracker = sock.send_multipart([env, *frames], copy=not frames,
                                              track=bool(frames))
            except zmq.Again:
                raise SendTimeout(f"peer {peer} did not take the message in "
                                  f"{timeout_s:.1f} s") from None
            # Return only once ZMQ has let go of the tensors' memory (the caller may reuse
            # it); for tcp that is when the bytes are in the kernel's socket buffer.
            try:
                if tracker is not None:
                    tracker.wait(max(0.001, timeout_s - (time.perf_counter() - t0)))
            except zmq.NotDone:
                raise SendTimeout(f"peer {peer} did not drain the message in "
                                  f"{timeout_s:.1f} s") from None
        except BaseException:
            self._pack_failed(peer, fields)
            raise
        nbytes = total + len(env)
        self.stats.record(self.stats.sent, header, nbytes, time.perf_counter() - t0)
        return nbytes

    # -- receiving ---------------------------------------------------------------------
    def poll_socket(self) -> zmq.Socket:
        return self._pull

    def _read_parts(self) -> list[zmq.Frame]:
        parts = [self._pull.recv(zmq.NOBLOCK, copy=False)]
        while parts[-1].more:
            if len(parts) > self.limits.max_tensors + 1:
                # NOTE: a multipart message arrives whole, so draining cannot block.
                while self._pull.recv(zmq.NOBLOCK, copy=False).more:
                    pass
                raise BadMessage("too many frames in one message")
            parts.append(self._pull.recv(zmq.NOBLOCK, copy=False))
        return parts

    def recv(self, timeout_ms: int = 0) -> Received | None:
        if self._closed:
            raise ConnectorError("connector is closed")
        if not self._pull.poll(timeout_ms, zmq.POLLIN):
            return None
        try:
            return self._decode(self._read_parts())
        except zmq.Again:  # NOTE: seen after a poll hit under CURVE; a wake-up, no message
            return None
        except BadMessage:
            self.stats.bad_messages += 1
            raise

    def _decode(self, parts: list[zmq.Frame]) -> Received:
        if len(parts[0]) > self.limits.max_header_bytes:
            raise BadMessage("header frame over the size limit")
        try:
            env = ENVELOPE_DECODER.decode(parts[0].buffer)
        except msgspec.DecodeError as e:
            raise BadMessage(f"undecodable envelope: {str(e)[:200]}") from None
        header = None
        try:
            try:
                header = self._header_decoder.decode(env.header)
            except msgspec.DecodeError as e:
                raise BadMessage(f"undecodable header: {str(e)[:200]}") from None
            nbytes = check_specs(env.tensors, self.limits)
            tensors = self._unpack(env, parts[1:])
        except BadMessage as e:
            self._discard(env)
            e.header = header
            raise
        seconds = elapsed_since(env.sent_at)
        self.stats.record(self.stats.received, header, nbytes, seconds)
        return Received(header, tensors, nbytes, seconds, self._peer_key(parts[0]))

    # -- closing -----------------------------------------------------------------------
    def _close_sockets(self, linger_ms: int = 0) -> None:
        for sock in self._peers.values():
            sock.close(linger_ms)
        self._peers.clear()
        self._pull.close(0)
