"""Intake: every message workers send the router, read, checked and acted on.

A message counts only from the current incarnation of a known worker, on the socket that
worker uses (a remote worker's name must be the name of the key it authenticated with),
and a request's message only for a live attempt that worker holds part of. Anything else
(garbage, an old incarnation, a dead attempt's late output) is dropped.

Token outputs go through the OutputProcessor to the client requests' queues; the prefill
worker's hand-off output moves a P/D attempt to its decode worker.
"""
from __future__ import annotations

import logging
import time

import msgspec
import zmq
import zmq.asyncio
from triptych.engine.outputs import EngineCoreOutput
from triptych.router.handle import WorkerHandle
from triptych.router.migration import Migration
from triptych.router.output_processor import OutputProcessor
from triptych.router.pixel_planner import PixelPlanner
from triptych.router.registry import WorkerRegistry
from triptych.router.requests import Attempt, RequestTable
from triptych.router.sockets import RouterSockets
from triptych.router.turns import Turns
from triptych.worker import wire

logger = logging.getLogger("triptych.router")


class Intake:
    def __init__(self, sockets: RouterSockets, registry: WorkerRegistry, table: RequestTable,
                 migration: Migration, outputs: OutputProcessor, pixels: PixelPlanner) -> None:
        self.sockets = sockets
        self.registry = registry
        self.table = table
        self.migration = migration
        self.outputs = outputs
        self.pixels = pixels

    async def read_loop(self, sock: zmq.asyncio.Socket, remote: bool) -> None:
        """Read ``sock`` until cancelled (a backlog in turns with everything else on the
        event loop, router/turns.py)."""
        turns = Turns()
        while True:
            frames = await sock.recv_multipart(copy=False)
            try:
                self.on_message(frames, remote)
            except Exception:  # a bug here must not stop every request: log, keep reading
                logger.exception("handling a worker message failed")
            await turns.take()

    def on_message(self, frames: list[zmq.Frame], remote: bool) -> None:
        ident = frames[0].bytes.decode("utf-8", "replace")
        if len(frames) < 2:
            return
        try:
            msg = wire.decode_from_worker(frames[1].bytes)
        except (msgspec.DecodeError, msgspec.ValidationError):
            logger.error("dropped a malformed message from %r", ident[:64])
            return
        # a worker's heartbeat thread has a socket of its own (worker/heartbeat.py)
        beat = ident.endswith(wire.HEARTBEAT_SUFFIX)
        if beat != isinstance(msg, wire.Heartbeat):
            return  # a heartbeat socket carries heartbeats only, and only it does
        ident = ident.removesuffix(wire.HEARTBEAT_SUFFIX)
        if remote:  # the claimed name must be the name of the key it authenticated with
            key_name = self.sockets.key_name(frames[0])
            if key_name is None or ident.partition("#")[0] != key_name:
                logger.warning("dropped a message from %r: not the holder of that name's key",
                               ident[:64])
                return
            if isinstance(msg, wire.Hello):
                self.registry.register_remote(ident, msg)
        worker = self.registry.current(ident, remote)
        if worker is None:
            return  # an old incarnation's late message, or not one of ours
        worker.last_seen = time.monotonic()
        if isinstance(msg, wire.Heartbeat):
            worker.busy_s = msg.busy_s
        elif isinstance(msg, wire.StepOutputs):
            self._on_outputs(worker, msg.outputs)
        elif isinstance(msg, wire.WorkerStats):
            worker.stats = msg.values
        elif isinstance(msg, wire.Hello):
            if not worker.up:
                logger.info("%s is up (pid %d)", worker.identity, msg.pid)
            worker.on_hello(msgspec.structs.asdict(msg))
        else:
            if isinstance(msg, wire.EncodeDone):
                # NOTE: counted even when its attempt has ended meanwhile: the work was done
                worker.served += 1
            a = self.table.live(getattr(msg, "request_id", ""))
            if a is not None and worker in a.workers:
                self._on_request_message(worker, a, msg)

    def _on_request_message(self, worker: WorkerHandle, a: Attempt,
                            msg: msgspec.Struct) -> None:
        m = self.migration
        if isinstance(msg, wire.KVReserved):
            if a.reserved is not None and not a.reserved.done():
                a.reserved.set_result(msg)
        elif isinstance(msg, wire.EncodeDone):
            a.encode = None
            a.uncharge(only=worker)
        elif isinstance(msg, wire.NeedEmbeddings):
            worker.embeddings.discard(msg.mm_hashes)  # its cache let them go
            m.encode_again(a, worker, msg.mm_hashes)
        elif isinstance(msg, wire.HandBack):  # preempted where it cannot be recomputed
            m.retry(a, f"handed back by {worker.name}", count=False)
        elif isinstance(msg, wire.RequestError):
            if msg.cache_missing:  # P0 and the worker disagreed: forget, send the pixels
                self.pixels.forget(worker, msg.cache_missing, msg.cache_seq)
                self.pixels.forget_prepared(a.child.parent.prompt, msg.cache_missing)
                m.retry(a, f"{worker.name}: processor cache miss", count=False)
            elif msg.retryable:
                m.retry(a, f"{worker.name}: {msg.message}")
            else:
                m.fail(a.child, ValueError(msg.message))

    def _on_outputs(self, worker: WorkerHandle, outs: list[EngineCoreOutput]) -> None:
        mine: list[EngineCoreOutput] = []
        orphans: list[str] = []
        for o in outs:
            a = self.table.live(o.request_id)
            if a is None:  # ended: a late output, or a run its abort overtook
                if o.finish_reason is None:
                    orphans.append(o.request_id)
                continue
            if a.worker is worker:
                mine += self._accept(a, worker, o)
            elif a.decode is worker and a.worker is not None:
                a.early.append(o)  # the decode side overtook the prefill side's hand-off
        if orphans:
            self.migration.abort_orphans(worker, orphans)
        results, stopped = self.outputs.process(mine)
        for cid in stopped:  # stop strings: the worker need not go on
            c = self.table.children.get(cid)
            if c is not None:
                self.migration.finish(c)
        for r in results:
            request = self.table.requests.get(r.request_id)
            if request is not None:
                request.queue.put_nowait(r)

    def _accept(self, a: Attempt, worker: WorkerHandle, o: EngineCoreOutput
                ) -> list[EngineCoreOutput]:
        """The outputs of one worker output, in the OutputProcessor's terms (child ids)."""
        cid = a.child.child_id
        o = msgspec.structs.replace(o, request_id=cid)
        if o.finish_reason == "handoff":  # the prefill worker is done; the decode one goes on
            worker.served += 1
            a.uncharge(only=worker)
            a.worker = a.decode
            early, a.early = a.early, []
            return [msgspec.structs.replace(o, finish_reason=None)] + [
                msgspec.structs.replace(e, request_id=cid) for e in early]
        if o.finish_reason is not None:
            worker.served += 1
            # only a decode worker still waiting for the KV (it ended before the hand-off)
            # holds it besides the worker that just finished it
            ended_early = [a.decode] if a.decode is not None and a.decode is not worker else []
            self.migration.finish(a.child, abort=ended_early)
        return [o]
