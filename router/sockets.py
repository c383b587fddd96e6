"""RouterSockets: the router's ends of the router <-> worker contract (``worker/wire.py``).

Two ROUTER sockets: the local one (ipc, in this server's private run dir) every worker the
supervisor starts connects to, and, when ``worker_address`` is set, the registration socket
for workers on other hosts (CURVE only; a worker is known by its key). A message goes out on
the socket its worker is connected to; a send to a dead or stuck worker fails (False)
instead of blocking the router.
"""
from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import msgspec
import zmq
import zmq.asyncio
from triptych.router.handle import WorkerHandle
from triptych.worker import wire

if TYPE_CHECKING:
    from triptych.connector.auth import Keys

logger = logging.getLogger("triptych.router")
SEND_TIMEOUT_S = 5.0


def _router_socket(ctx: zmq.asyncio.Context) -> zmq.asyncio.Socket:
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a dead peer fails loudly
    sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_MESSAGE_BYTES)
    sock.setsockopt(zmq.LINGER, 0)
    return sock


class RouterSockets:
    def __init__(self, run_dir: str, curve: tuple[str, Keys, list[bytes]] | None = None
                 ) -> None:
        """Bind the local socket in ``run_dir`` (its address: ``self.address``). With
        ``curve`` (host, the router's keys, the client keys it admits) the workers the
        supervisor starts are Ray actors on any node: the socket is tcp on that host,
        CURVE only (router/ray_backend.py)."""
        self.ctx = zmq.asyncio.Context()
        self.local = _router_socket(self.ctx)
        self.remote: zmq.asyncio.Socket | None = None
        self.key_names: dict[str, str] = {}  # public key (z85) -> node name
        self._auth = self._local_auth = None
        if curve is None:
            self.address = f"ipc://{run_dir}/router"
            self.local.bind(self.address)
        else:
            from triptych.connector.auth import secure_server

            host, keys, allowed = curve
            self._local_auth = secure_server(self.local, keys, allowed)
            self.local.bind(f"tcp://{host}:0")
            self.address = self.local.getsockopt_string(zmq.LAST_ENDPOINT)

    def open_remote(self, address: str, keys_dir: str) -> None:
        """The registration socket for workers on other hosts: CURVE only, bound where the
        operator said. Only the keys in ``keys_dir`` (other than the router's) may connect."""
        from triptych.connector.auth import load_keys, secure_server

        keys = load_keys(keys_dir, "router")
        self.key_names = {v.decode(): k for k, v in keys.peers.items() if k != "router"}
        self.remote = _router_socket(self.ctx)
        self._auth = secure_server(self.remote, keys, [k.encode() for k in self.key_names])
        self.remote.bind(address)
        logger.info("workers on other hosts register at %s (CURVE, %d known keys)", address,
                    len(self.key_names))

    def key_name(self, frame: zmq.Frame) -> str | None:
        """The node name of the key a message on the remote socket was authenticated with."""
        return self.key_names.get(frame.get("User-Id") or "")

    async def send_frames(self, worker: WorkerHandle, frames: list[bytes]) -> bool:
        """False when the worker is not connected (dead, restarting) or stuck."""
        sock = self.remote if worker.remote else self.local
        if sock is None:
            return False
        try:
            await asyncio.wait_for(
                sock.send_multipart([worker.identity.encode(), *frames]), SEND_TIMEOUT_S)
            return True
        except (zmq.ZMQError, asyncio.TimeoutError):
            return False

    async def send(self, worker: WorkerHandle, msg: msgspec.Struct) -> bool:
        """Send one message without tensors (see ``send_frames``)."""
        return await self.send_frames(worker, wire.encode(msg))

    def close(self) -> None:
        """Close both sockets and the context (nothing queued is sent)."""
        self.local.close(0)
        if self._local_auth is not None:
            self._local_auth.close()
        if self.remote is not None:
            self.remote.close(0)
            self._auth.close()
        self.ctx.term()
