"""Connections before any request: deadlines and caps that come before the key check.

uvicorn waits forever for a new connection's first request line and headers, and counts an
idle connection toward ``limit_concurrency`` like a running request: 1,030 sockets that
send nothing (or their headers a line at a time) made /health answer 503 for as long as
they stayed open, no key needed. Here every connection is in one of two states:

    idle     no request in progress: just opened, or kept alive after a response.
             Its next request's headers must arrive within ``header_timeout_s`` (counted
             from the open, or from the end of the last response), else it is closed.
    busy     a request's headers arrived; its body and response are the app's business
             (the body has its own deadline: api/middleware.py).

Idle connections are capped, server-wide (``max_idle``) and per client address
(``max_idle_per_client``): a new connection past a cap closes the *oldest* idle one (of
that address first), so a new arrival always gets in. Under the address's cap only a
connection idle for longer than a grace period (a second, or half the header deadline) is
closed: a burst of connections that send their requests at once (a batch client opening
200, a load balancer's probes) is busy within a round trip and is never pushed out; a pile
of silent sockets only pushes out each other. The server-wide cap holds at once (it keeps
idle connections below uvicorn's ``--limit-concurrency``).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from typing import Any

from uvicorn.protocols.http.h11_impl import H11Protocol

logger = logging.getLogger("triptych.api")


class ConnectionGuard:
    """The idle connections of one server, oldest first, and their deadlines."""

    def __init__(self, header_timeout_s: float = 10.0, max_idle: int = 512,
                 max_idle_per_client: int = 128) -> None:
        self.header_timeout_s = header_timeout_s
        self.max_idle, self.max_idle_per_client = max_idle, max_idle_per_client
        self.grace_s = min(1.0, header_timeout_s / 2)  # idle this long before a cap may close it
        # protocol -> (client address, when it became idle), oldest first
        self._idle: OrderedDict[Any, tuple[str, float]] = OrderedDict()
        self._by_client: dict[str, int] = {}
        self.closed_idle = 0  # connections closed by a cap or the header deadline

    @property
    def num_idle(self) -> int:
        return len(self._idle)

    def idle(self, proto: Any, client: str) -> None:
        """``proto`` now waits for a request (opened, or done with one): make room for it."""
        if proto in self._idle:
            return
        if self._by_client.get(client, 0) >= self.max_idle_per_client:
            self._close_oldest(client)
        if len(self._idle) >= self.max_idle:
            self._close_oldest(None)
        self._idle[proto] = (client, time.monotonic())
        self._by_client[client] = self._by_client.get(client, 0) + 1

    def busy(self, proto: Any) -> None:
        """``proto`` has a request in progress (or is gone): no longer idle."""
        client, _ = self._idle.pop(proto, (None, 0.0))
        if client is not None:
            left = self._by_client[client] - 1
            if left:
                self._by_client[client] = left
            else:
                del self._by_client[client]

    def _close_oldest(self, client: str | None) -> None:
        """Close the oldest idle connection: server-wide, whatever its age (the cap keeps
        idle connections below ``--limit-concurrency``); of ``client``, only one idle past
        the grace period, else none (the address's cap is passed for a moment: its fresh
        connections are about to send their requests)."""
        old_enough = time.monotonic() - (self.grace_s if client is not None else 0.0)
        victim = next((p for p, (c, since) in self._idle.items()
                       if (client is None or c == client) and since <= old_enough), None)
        if victim is not None:
            self.busy(victim)
            self.closed_idle += 1
            victim.close_idle("too many idle connections")


def guarded_protocol(guard: ConnectionGuard) -> type[H11Protocol]:
    """uvicorn's h11 protocol with ``guard``'s states, deadline and caps (pass it as
    ``uvicorn.Config(http=...)``)."""

    class GuardedH11Protocol(H11Protocol):
        _deadline: asyncio.TimerHandle | None = None

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._await_request()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_deadline()
            guard.busy(self)
            super().connection_lost(exc)

        def handle_events(self) -> None:
            before = self.cycle
            super().handle_events()
            if self.cycle is not before:  # a request's headers arrived
                self._cancel_deadline()
                guard.busy(self)

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing() and (
                    self.cycle is None or self.cycle.response_complete):
                self._await_request()

        def _await_request(self) -> None:
            self._cancel_deadline()
            self._deadline = self.loop.call_later(guard.header_timeout_s, self.close_idle,
                                                  "no request headers in time")
            guard.idle(self, self.client[0] if self.client else "?")

        def _cancel_deadline(self) -> None:
            if self._deadline is not None:
                self._deadline.cancel()
                self._deadline = None

        def close_idle(self, why: str) -> None:
            """Close this connection, which has no request in progress."""
            self._cancel_deadline()
            guard.busy(self)
            if self.cycle is not None and not self.cycle.response_complete:
                return  # (a request started after all: the app owns the connection now)
            if not self.transport.is_closing():
                logger.debug("closing an idle connection from %s: %s", self.client, why)
                self.transport.close()

    return GuardedH11Protocol


__all__ = ["ConnectionGuard", "guarded_protocol"]
