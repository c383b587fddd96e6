"""A minimal ZAP (ZeroMQ RFC 27) handler: admits a CURVE client only if its public key is
on the allow-list of the server socket's domain.

libzmq asks the handler bound at inproc://zeromq.zap.01 *of the server socket's context*
during every handshake, so there is one handler thread per context, shared by every
secured socket of it (each with its own domain and allow-list). It refuses every other
mechanism and every unknown domain.
"""
from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from typing import ClassVar

import zmq
from zmq.utils import z85

from .envelope import ConnectorError

logger = logging.getLogger("triptych.connector")
_ZAP_ENDPOINT = "inproc://zeromq.zap.01"


class ZapHandler:
    _by_ctx: ClassVar[dict[int, ZapHandler]] = {}  # libzmq context address -> its handler
    _lock = threading.Lock()

    def __init__(self, ctx: zmq.Context) -> None:
        # NOTE: a plain (sync) shadow of the caller's context, which may be a
        # zmq.asyncio.Context: the handler thread needs blocking sockets.
        self.ctx = zmq.Context.shadow(ctx.underlying)
        self.denied = 0  # handshakes refused (a counter for tests and logs)
        self._allowed: dict[bytes, frozenset[bytes]] = {}  # domain -> client keys (z85)
        self._stop_addr = f"inproc://triptych-zap-stop-{id(self)}"
        self._ready = threading.Event()
        self._error: str | None = None
        self._thread = threading.Thread(target=self._run, name="zap", daemon=True)

    @classmethod
    def acquire(cls, ctx: zmq.Context, domain: str, allowed: Iterable[bytes]) -> ZapHandler:
        """The context's handler (started on first use) with ``domain`` registered."""
        with cls._lock:
            h = cls._by_ctx.get(ctx.underlying)
            if h is None:
                h = cls(ctx)
                h._thread.start()
                if not h._ready.wait(5) or h._error:
                    raise ConnectorError(f"cannot start the ZAP handler: {h._error}")
                cls._by_ctx[ctx.underlying] = h
            h.set_allowed(domain, allowed)
            return h

    def set_allowed(self, domain: str, keys: Iterable[bytes]) -> None:
        keys = frozenset(keys)
        if any(len(k) != 40 for k in keys):
            raise ConnectorError("a CURVE public key is 40 z85 characters")
        self._allowed[domain.encode()] = keys  # one assignment: atomic for the thread

    def release(self, domain: str) -> None:
        """Forget ``domain``; the last one stops the thread (before ctx.term())."""
        # NOTE: stopped under the lock, so a new handler for this context cannot try to
        # bind the ZAP endpoint before the old one has let go of it.
        with ZapHandler._lock:
            self._allowed.pop(domain.encode(), None)
            if self._allowed:
                return
            ZapHandler._by_ctx.pop(self.ctx.underlying, None)
            stop = self.ctx.socket(zmq.PUSH)
            stop.setsockopt(zmq.LINGER, 1000)
            stop.connect(self._stop_addr)
            stop.send(b"")
            stop.close()
            self._thread.join(timeout=5)

    def _answer(self, msg: list[bytes]) -> list[bytes]:
        if len(msg) < 6:
            return [b"1.0", b"", b"500", b"malformed ZAP request", b"", b""]
        version, request_id, domain, address, _identity, mechanism = msg[:6]
        allowed = self._allowed.get(domain)
        if version == b"1.0" and mechanism == b"CURVE" and allowed is not None \
                and len(msg) == 7 and len(msg[6]) == 32:
            key = z85.encode(msg[6])
            if key in allowed:
                return [b"1.0", request_id, b"200", b"OK", key, b""]
        self.denied += 1
        logger.debug("refused a %s handshake from %s (domain %s)", mechanism, address, domain)
        return [b"1.0", request_id, b"400", b"not allowed", b"", b""]

    def _run(self) -> None:
        zap = self.ctx.socket(zmq.REP)
        stop = self.ctx.socket(zmq.PULL)
        for s in (zap, stop):
            s.setsockopt(zmq.LINGER, 0)
        try:
            zap.bind(_ZAP_ENDPOINT)
            stop.bind(self._stop_addr)
        except zmq.ZMQError as e:
            self._error = f"{e} (another ZAP handler already serves this context?)"
            zap.close()
            stop.close()
            self._ready.set()
            return
        self._ready.set()
        poller = zmq.Poller()
        poller.register(zap, zmq.POLLIN)
        poller.register(stop, zmq.POLLIN)
        try:
            while True:
                events = dict(poller.poll())
                if stop in events:
                    break
                if zap in events:
                    zap.send_multipart(self._answer(zap.recv_multipart()))
        finally:
            zap.close()
            stop.close()
