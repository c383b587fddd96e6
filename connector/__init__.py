"""connector: moves embeddings and KV blocks between worker pools.

One interface (``Connector``: send / recv / poll_socket / close), three transports:
``inproc`` (one process, by reference), ``shm`` (one host, /dev/shm + ipc://), ``tcp``
(across hosts, ZMQ with optional CURVE). See connector/README.md.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .base import Connector, ConnectorStats, Received, TransferStats
from .envelope import BadMessage, ConnectorError, Limits, SendTimeout
from .segments import cleanup_stale  # for the supervisor: at start and after a death

if TYPE_CHECKING:
    from .auth import Keys

KINDS = ("inproc", "shm", "tcp")

__all__ = ["KINDS", "BadMessage", "Connector", "ConnectorError", "ConnectorStats", "Limits",
           "Received", "SendTimeout", "TransferStats", "cleanup_stale", "make_connector",
           "resolve_kind"]


def resolve_kind(kind: str, same_host: bool, same_process: bool = False) -> str:
    """The ``kv_transfer`` knob to a transport: auto = inproc in one process, shm on one
    host, tcp across hosts."""
    if kind == "auto":
        return "inproc" if same_process else "shm" if same_host else "tcp"
    if kind not in KINDS:
        raise ValueError(f"kv_transfer must be auto or one of {', '.join(KINDS)}, not {kind!r}")
    if kind == "inproc" and not same_process:
        raise ValueError("kv_transfer=inproc joins endpoints of one process only")
    if kind == "shm" and not same_host:
        raise ValueError("kv_transfer=shm joins endpoints of one host only")
    return kind


def make_connector(kind: str, *, name: str, header_type: Any, limits: Limits | None = None,
                   send_timeout_ms: int = 5000, bind_host: str = "127.0.0.1", port: int = 0,
                   advertise_host: str | None = None, keys: Keys | None = None,
                   shm_prefix: str = "triptych-", segment_ttl_s: float = 30.0) -> Connector:
    """A data-plane endpoint of ``kind`` ("inproc" | "shm" | "tcp").

    ``header_type``: the msgspec Struct type (or Union of tagged Structs) this endpoint
    accepts. ``bind_host`` / ``port`` / ``advertise_host`` / ``keys``: tcp only.
    ``shm_prefix`` / ``segment_ttl_s``: shm only (a segment nobody took within the TTL is
    unlinked by its sender).
    """
    limits = limits or Limits()
    if kind == "inproc":
        from .inproc import InprocConnector
        return InprocConnector(name, header_type, limits, send_timeout_ms)
    if kind == "shm":
        from .shm import ShmConnector
        return ShmConnector(name, header_type, limits, send_timeout_ms, prefix=shm_prefix,
                            segment_ttl_s=segment_ttl_s)
    if kind == "tcp":
        from .tcp import TcpConnector
        return TcpConnector(name, header_type, limits, send_timeout_ms, bind_host=bind_host,
                            port=port, advertise_host=advertise_host, keys=keys)
    raise ValueError(f"unknown connector kind {kind!r} (one of {', '.join(KINDS)})")
