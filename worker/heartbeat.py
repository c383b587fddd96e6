"""HeartbeatThread: a worker's proof of life, independent of what its loop is doing.

    worker process
      main thread:  poll -> handle -> step (may take long: a big prefill, a 12 MP image)
      heartbeat:    every HEARTBEAT_INTERVAL_S send Heartbeat(busy_s) on its own DEALER
                    (identity "<worker id>~hb") to the router

Why a thread and its own socket: a ZMQ socket belongs to one thread, and a heartbeat sent
from the loop would stop during a long step, so a busy worker would look dead. A thread
stops only when the whole process does (SIGSTOP, a kernel freeze, death): exactly what the
router must catch. torch releases the GIL inside its ops, so a long forward does not starve
it. A step that never ends (a hung kernel) keeps the heartbeat going; ``busy_s`` makes that
visible in /health without mistaking a slow step for a dead worker.
"""
from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

import zmq
from triptych.worker import wire

logger = logging.getLogger("triptych.worker")
HEARTBEAT_INTERVAL_S = 0.5  # the router's --worker-heartbeat-timeout is many of these


class HeartbeatThread:
    def __init__(self, ctx: zmq.Context, worker_id: str, router_address: str,
                 secure: Callable[[zmq.Socket], None] | None = None,
                 interval_s: float = HEARTBEAT_INTERVAL_S) -> None:
        """``secure``: sets up CURVE on the socket (a router on another host)."""
        self._ctx, self._id, self._address = ctx, worker_id, router_address
        self._secure, self._interval = secure, interval_s
        self._stop = threading.Event()
        self._step_started = 0.0  # monotonic start of the running step; 0: idle
        self._thread = threading.Thread(target=self._run, name="heartbeat", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def step_begins(self) -> None:
        """The loop enters a step (a float store: atomic under the GIL)."""
        self._step_started = time.monotonic()

    def step_ends(self) -> None:
        self._step_started = 0.0

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(5)

    def _run(self) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        try:
            sock.setsockopt(zmq.IDENTITY, (self._id + wire.HEARTBEAT_SUFFIX).encode())
            sock.setsockopt(zmq.LINGER, 0)
            sock.setsockopt(zmq.SNDHWM, 4)  # a router that reads nothing: drop, never queue
            if self._secure is not None:
                self._secure(sock)
            sock.connect(self._address)
            while not self._stop.is_set():
                started = self._step_started
                busy = time.monotonic() - started if started else 0.0
                try:
                    sock.send_multipart(wire.encode(wire.Heartbeat(busy)), zmq.NOBLOCK)
                except zmq.Again:
                    pass  # the router is not reading; it will notice the silence itself
                self._stop.wait(self._interval)
        except Exception:
            logger.exception("the heartbeat thread failed")
        finally:
            sock.close(0)
