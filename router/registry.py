"""WorkerRegistry: the router's workers, local and remote, by name; which one takes work.

Local workers are registered once at start (the supervisor restarts their processes; the
handle stays). A worker on another host registers itself with a Hello on the CURVE socket:
the first Hello of a node adds its handle; a Hello from a new incarnation of a known node
(it restarted) ends what the old one was running. Remote workers are not ours to restart:
one silent for --worker-heartbeat-timeout is taken for dead; a name a local worker holds is
refused, and so is a worker whose model fingerprint is not ours (worker/fingerprint.py).
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Callable
from typing import Any

from triptych.router.errors import EngineDeadError
from triptych.router.handle import WorkerHandle
from triptych.router.layout import Layout
from triptych.router.routing import pick
from triptych.worker import wire

logger = logging.getLogger("triptych.router")


class WorkerRegistry:
    def __init__(self, layout: Layout, block_size: int,
                 on_exit: Callable[[WorkerHandle, int], None],
                 heartbeat_timeout_s: float = 10.0, model_fingerprint: str = "") -> None:
        """``on_exit(handle, code)``: a worker died (here: a remote one, or a restarted
        node's old incarnation); the supervisor reports local deaths the same way. A
        remote worker silent for ``heartbeat_timeout_s`` is taken for dead (its heartbeat
        thread sends every 0.5 s, worker/heartbeat.py)."""
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.max_step_s = 0.0  # a remote worker inside one step longer than this: dropped
        self.model_fingerprint = model_fingerprint  # ours: a remote worker must match it
        self.refused: dict[str, str] = {}  # remote names refused, and why (logged once)
        self.layout = layout
        self.block_size = block_size
        self.on_exit = on_exit
        self.workers: list[WorkerHandle] = []  # in registration order (/health)
        self._by_name: dict[str, WorkerHandle] = {}

    def add_local(self, pool: str, index: int, config: dict[str, Any],
                  num_threads: int) -> WorkerHandle:
        """A worker the supervisor starts (and restarts: the handle stays)."""
        return self._add(WorkerHandle(pool, index, config, num_threads))

    def _add(self, w: WorkerHandle) -> WorkerHandle:
        self.workers.append(w)
        self._by_name[w.name] = w
        return w

    def remove(self, w: WorkerHandle) -> None:
        """A worker slot the pool no longer has (shrunk: router/elastic.py)."""
        if w in self.workers:
            self.workers.remove(w)
        if self._by_name.get(w.name) is w:
            del self._by_name[w.name]

    def current(self, ident: str, remote: bool) -> WorkerHandle | None:
        """The worker whose current incarnation is ``ident`` on that socket, else None (an
        old incarnation's late message, or not one of ours)."""
        w = self._by_name.get(ident.partition("#")[0])
        if w is None or w.identity != ident or (w.remote is not None) != remote:
            return None
        return w

    def register_remote(self, ident: str, msg: wire.Hello) -> WorkerHandle | None:
        """A Hello on the remote socket (its sender's key already checked against the
        name it claims)."""
        if msg.pool not in self.layout.pools or msg.worker_id != ident:
            logger.warning("refused %s: pool %r is not in this layout (%s)", ident, msg.pool,
                           self.layout)
            return None
        name = ident.partition("#")[0]
        w = self._by_name.get(name)
        why = ""
        if w is not None and w.remote is None:
            why = f"its name {name!r} is a local worker's; give it another (--name)"
        elif msg.model_fingerprint != self.model_fingerprint:
            why = (f"it serves another checkpoint (model fingerprint "
                   f"{msg.model_fingerprint[:12] or 'missing'} != ours "
                   f"{self.model_fingerprint[:12]})")
        if why:
            if self.refused.get(ident) != why:
                logger.error("refused worker %s from another host: %s", ident, why)
            self.refused[ident] = why
            return None
        if w is None:
            index = sum(1 for x in self.workers if x.pool == msg.pool)
            w = self._add(WorkerHandle(msg.pool, index, {}, remote=ident))
        elif w.remote != ident:  # the same node, restarted: its old requests are gone
            if w.up:
                self.on_exit(w, -1)
            w.remote = ident
            w.restarts += 1
        if not w.up:
            logger.info("%s (another host, pool %s) registered", ident, msg.pool)
        w.state = "up"
        return w

    async def watch_remote(self) -> None:
        """Take a silent remote worker for dead. Runs until cancelled."""
        last = resumed = time.monotonic()
        while True:
            now = time.monotonic()
            if now - last > 2.0:  # P0's loop was blocked: unread heartbeats are no silence
                resumed = now
            last = now
            for w in list(self.workers):
                if w.remote and w.up and \
                        now - max(w.last_seen, resumed) > self.heartbeat_timeout_s:
                    w.state = "dead"
                    logger.error("%s (another host) sent nothing for %.0f s; taken for dead",
                                 w.name, self.heartbeat_timeout_s)
                    self.on_exit(w, -1)
                elif w.remote and w.up and self.max_step_s and w.busy_s > self.max_step_s:
                    w.state = "dead"
                    logger.error("%s (another host) is inside one step for %.0f s (hung?); "
                                 "dropped (restart it; or raise --max-step-seconds)",
                                 w.name, w.busy_s)
                    self.on_exit(w, -1)
            await asyncio.sleep(0.5)

    def stop_remote(self) -> None:
        """The router stops: remote workers are no longer served (theirs to stop)."""
        for w in self.workers:
            if w.remote:
                w.state = "stopped"

    def pool(self, pool: str) -> list[WorkerHandle]:
        """Every worker of ``pool``, alive or not."""
        return [w for w in self.workers if w.pool == pool]

    def live(self, pool: str) -> list[WorkerHandle]:
        """The workers of ``pool`` that are up."""
        return [w for w in self.workers if w.pool == pool and w.up]

    def choose(self, pool: str, hashes: list[bytes]) -> WorkerHandle:
        """The live worker of ``pool`` with the least work once this prompt (its block
        ``hashes``) is added (router/routing.py); a prompt-holding pool records it there."""
        live = self.live(pool)
        if not live:
            raise EngineDeadError(f"no live worker in the {pool} pool (restarting); retry "
                                  "shortly")
        w = pick(live, [w.load for w in live],
                 [w.prefix.match(hashes) * self.block_size for w in live])
        if pool != "encode":
            w.record_prompt(hashes)
        return w
