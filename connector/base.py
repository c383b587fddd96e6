"""The connector interface: one data-plane endpoint per worker.

    conn = make_connector("shm", name="decode-0", header_type=KVTransfer | Embeddings)
    conn.address                              # give this to peers (via the router)
    n = conn.send(peer_address, header, [k0, v0, k1, v1, ...])   # bytes moved
    msg = conn.recv(timeout_ms=100)           # Received | None; raises BadMessage
    poller.register(conn.poll_socket(), zmq.POLLIN)   # beside the worker's control socket
    conn.close()

Every endpoint both sends (to any peer address of its own transport) and receives (on its
own address). ``header`` is any msgspec Struct; the receiver decodes it with the type it
was built with, never one the peer names. Tensors arrive checked (dtype, shape, byte
length) and on the CPU (inproc: the sender's very tensors, on their device).

An endpoint is used from one thread (ZMQ sockets are not thread-safe).
"""
from __future__ import annotations

import math
import time
from abc import ABC, abstractmethod
from collections.abc import Sequence
from dataclasses import dataclass, field

import msgspec
import torch
import zmq
from typing_extensions import Self  # a torch dependency; typing.Self needs 3.11


@dataclass
class Received:
    """One message as the receiver sees it."""

    header: msgspec.Struct  # decoded with the receiver's header_type
    tensors: list[torch.Tensor]  # checked against their specs, in the sender's order
    nbytes: int  # tensor bytes carried
    seconds: float  # sender's send() start -> tensors ready here (sender's clock: skew
    # across hosts shows up here; clamped at 0)
    peer_key: str | None = None  # tcp with CURVE: the sender's authenticated public key (z85)


@dataclass
class TransferStats:
    messages: int = 0
    bytes: int = 0
    seconds: float = 0.0

    def add(self, nbytes: int, seconds: float) -> None:
        self.messages += 1
        self.bytes += nbytes
        self.seconds += seconds


@dataclass
class ConnectorStats:
    """Counters for metrics, keyed by header type name (e.g. "KVTransfer") so KV and
    embedding traffic are told apart without the connector knowing either."""

    sent: dict[str, TransferStats] = field(default_factory=dict)
    received: dict[str, TransferStats] = field(default_factory=dict)
    bad_messages: int = 0  # dropped by recv (BadMessage raised)
    reaped_segments: int = 0  # shm: segments unlinked because no receiver took them in time

    def record(self, table: dict[str, TransferStats], header: msgspec.Struct, nbytes: int,
               seconds: float) -> None:
        table.setdefault(type(header).__name__, TransferStats()).add(nbytes, seconds)


class Connector(ABC):
    """A data-plane endpoint: receives on ``address``, sends to peers' addresses."""

    kind: str  # "inproc" | "shm" | "tcp"
    address: str  # where peers send to this endpoint
    stats: ConnectorStats

    @abstractmethod
    def send(self, peer: str, header: msgspec.Struct, tensors: Sequence[torch.Tensor] = (),
             timeout_ms: int | None = None) -> int:
        """Send one message to the endpoint at ``peer``; return the bytes moved (tensor
        bytes + frame 0). Returns once the tensors' bytes are no longer needed (the caller
        may reuse them). Raises SendTimeout after ``timeout_ms`` (default: the endpoint's
        send timeout) if the peer does not take it; ConnectorError if it cannot be sent."""

    @abstractmethod
    def recv(self, timeout_ms: int = 0) -> Received | None:
        """Wait up to ``timeout_ms`` for one message; None if none came. A malformed
        message is consumed and raises BadMessage; the next call works as usual."""

    @abstractmethod
    def poll_socket(self) -> zmq.Socket:
        """The socket that becomes readable (POLLIN) when recv has a message."""

    @abstractmethod
    def close(self) -> None:
        """Release the socket, files and segments this endpoint owns. Idempotent."""

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def elapsed_since(sent_at: float) -> float:
    """Seconds from a peer's wall-clock stamp to now, clamped to [0, 1 day] (forged or
    skewed stamps must not poison a histogram)."""
    dt = time.time() - sent_at
    return min(max(dt, 0.0), 86400.0) if math.isfinite(dt) else 0.0
