"""Router (P0): the one interface the HTTP server and the offline LLM use to reach workers.

    submit(request_id, prompt, params) -> async iterator of RequestDelta (ValueError: refused)
    abort([ids]) · alive() · health() · stats() · new_request_id(prefix) · shutdown()

    client request --fan out n--> child requests --pick a worker--> AddRequest (ROUTER socket)
    worker StepOutputs (token ids) --> OutputProcessor (text, stop strings) --> RequestDelta

Workers are processes started and restarted by the ``Supervisor``; each connects a DEALER
to this router's ROUTER socket with the identity ``<pool>-<index>#<incarnation>``, so an
old incarnation's late messages are recognised and dropped. When a worker dies, each of
its requests resumes on a live worker of the same pool from the tokens already streamed
(greedy outputs equal an undisturbed run); with no live worker left they end at once with
``EngineDeadError`` (HTTP 503, or an SSE error event mid-stream). A request that was on a
worker that died MAX_MIGRATIONS times is failed instead: it may be what kills workers.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import os
import shutil
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

import msgspec
import zmq
import zmq.asyncio
from triptych.api.processor import ProcessedPrompt
from triptych.api.routing import PrefixIndex, pick
from triptych.api.supervisor import Supervisor, Worker, make_run_dir
from triptych.config import EngineConfig
from triptych.engine import wire
from triptych.engine.block_hash import chain_hashes
from triptych.engine.output_processor import OutputProcessor
from triptych.engine.outputs import EngineCoreOutput, RequestOutput
from triptych.engine.sampling_params import SamplingParams

logger = logging.getLogger("triptych.router")
MAX_MIGRATIONS = 2
SEND_TIMEOUT_S = 5.0


class EngineDeadError(RuntimeError):
    """No live worker can take, or finish, the request (the server answers 503)."""


@dataclass(eq=False)
class _Parent:
    request_id: str
    prompt: ProcessedPrompt
    queue: asyncio.Queue
    children: list[_Child] = field(default_factory=list)
    hashes: list[bytes] = field(default_factory=list)  # prompt block hashes (routing)


@dataclass(eq=False)
class _Child:
    child_id: str
    params: SamplingParams
    parent: _Parent
    worker: Worker | None = None
    cost: int = 0  # queued tokens charged to the worker
    migrations: int = 0
    done: bool = False


def pool_layout(config: EngineConfig) -> dict[str, int]:
    """Pool name -> worker count for the knobs (all pool sizes 0: colocated replicas)."""
    if not config.decode_workers:
        return {"colocated": config.data_parallel_size}
    if config.encode_workers or config.prefill_workers:
        raise ValueError("encode/prefill pools are not available in this build yet; "
                         "use decode_workers alone (data-parallel PD workers)")
    return {"decode": config.decode_workers}


class Router:
    def __init__(self, config: EngineConfig, tokenizer: Any, *,
                 start_timeout_s: float = 600.0, threads_per_worker: int | None = None) -> None:
        self.config = config
        self.tokenizer = tokenizer
        self.layout = pool_layout(config)
        self.outputs = OutputProcessor(tokenizer)
        self._start_timeout_s = start_timeout_s
        n_workers = sum(self.layout.values())
        self._threads = threads_per_worker or max(1, (os.cpu_count() or 1) // n_workers)
        self._parents: dict[str, _Parent] = {}
        self._children: dict[str, _Child] = {}
        self._by_name: dict[str, Worker] = {}
        self._load: dict[Worker, int] = {}
        self._prefix: dict[Worker, PrefixIndex] = {}
        self._ids = itertools.count()
        self.migrations_total = 0
        self._tasks: list[asyncio.Task] = []
        self._closed = False
        self._start_failure: str | None = None
        self._started = False
        self.supervisor: Supervisor | None = None

    # -- life cycle -----------------------------------------------------------------------
    async def start(self) -> None:
        self._dir = make_run_dir()
        self._ctx = zmq.asyncio.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a send to a dead peer fails loudly
        self._sock.setsockopt(zmq.MAXMSGSIZE, wire.MAX_MESSAGE_BYTES)
        self._sock.setsockopt(zmq.LINGER, 0)
        address = f"ipc://{self._dir}/router"
        self._sock.bind(address)
        logger.info("router listening; sockets in %s", self._dir)
        self.supervisor = Supervisor(address, self.tokenizer.eos_token_id, self._on_worker_exit)
        config = dataclasses.asdict(self.config)
        for pool, n in self.layout.items():
            for i in range(n):
                w = Worker(pool, i, config, self._threads)
                self._load[w] = 0
                self._prefix[w] = PrefixIndex(1)
                self.supervisor.spawn(w)
                self._by_name[w.name] = w
        self._tasks = [asyncio.create_task(self._read_loop()),
                       asyncio.create_task(self.supervisor.watch())]
        deadline = time.monotonic() + self._start_timeout_s
        while not all(w.state == "up" for w in self.supervisor.workers):
            if self._start_failure:
                await self.shutdown()
                raise EngineDeadError(self._start_failure)
            if time.monotonic() > deadline:
                await self.shutdown()
                raise EngineDeadError("the workers did not start in time")
            await asyncio.sleep(0.05)
        self._started = True

    async def shutdown(self) -> None:
        """Stop every worker (clean exit, then kill) and remove the socket dir."""
        if self._closed:
            return
        self._closed = True
        for p in list(self._parents.values()):
            p.queue.put_nowait(EngineDeadError("the server is shutting down"))
        if self.supervisor:
            await self.supervisor.stop_all()
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        self._sock.close(0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    # -- the interface --------------------------------------------------------------------
    def _live(self, pool: str) -> list[Worker]:
        assert self.supervisor is not None
        return [w for w in self.supervisor.workers if w.pool == pool and w.state == "up"]

    def alive(self) -> bool:
        return not self._closed and all(self._live(p) for p in self.layout)

    def health(self) -> dict[str, Any]:
        """{"status": ok | degraded | unavailable, "pools": {pool: {"live", "workers"}}}."""
        pools: dict[str, Any] = {}
        for pool in self.layout:
            ws = [w for w in self.supervisor.workers if w.pool == pool] if self.supervisor else []
            pools[pool] = {"live": sum(w.state == "up" for w in ws), "workers": [
                {"index": w.index, "pid": w.pid, "state": w.state, "restarts": w.restarts,
                 "requests": sum(1 for c in self._children.values() if c.worker is w)}
                for w in ws]}
        if self._closed or any(p["live"] == 0 for p in pools.values()):
            status = "unavailable"
        elif any(p["live"] < len(p["workers"]) for p in pools.values()):
            status = "degraded"
        else:
            status = "ok"
        return {"status": status, "pools": pools}

    def stats(self) -> dict[str, float]:
        """Every live worker's gauges and counters summed (KV usage averaged), each pool's
        under ``pool/<name>/<key>``, plus the router's own counters."""
        out: dict[str, float] = {}
        for pool in self.layout:
            ws = self._live(pool) if self.supervisor else []
            agg: dict[str, float] = {}
            for w in ws:
                for k, v in w.stats.items():
                    agg[k] = agg.get(k, 0.0) + v
            if ws and "kv_cache_usage_perc" in agg:
                agg["kv_cache_usage_perc"] /= len(ws)
            agg["workers_live"] = len(ws)
            for k, v in agg.items():
                out[f"pool/{pool}/{k}"] = v
                out[k] = out.get(k, 0.0) + v
        out["worker_restarts_total"] = self.supervisor.restarts_total if self.supervisor else 0
        out["request_migrations_total"] = self.migrations_total
        return out

    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-{os.getpid()}-{next(self._ids)}"

    @property
    def num_in_flight(self) -> int:
        return len(self._parents)

    async def submit(self, request_id: str, prompt: ProcessedPrompt, params: SamplingParams,
                     stream: bool = True) -> AsyncIterator[wire.RequestDelta]:
        """Stream a request's deltas. Raises ValueError if a worker refuses it and
        EngineDeadError if no live worker can run or finish it."""
        if self._closed:
            raise EngineDeadError("the server is shutting down")
        params.verify()
        parent = _Parent(request_id, prompt, asyncio.Queue())
        kids = self.outputs.add(request_id, prompt.prompt_text, prompt.prompt_token_ids,
                                params, stream)
        self._parents[request_id] = parent
        parent.children = [_Child(cid, sp, parent) for cid, sp in kids]
        for c in parent.children:
            self._children[c.child_id] = c
        finished = False
        try:
            parent.hashes = chain_hashes(prompt.prompt_token_ids, prompt.mm_items,
                                         self.config.block_size)
            worker = self._choose(parent)
            for c in parent.children:
                await self._dispatch(c, worker)
            while True:
                item = await parent.queue.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            for c in parent.children:
                if not finished and not c.done and c.worker is not None:
                    await self._send(c.worker, wire.AbortRequest([c.child_id]))
                self._release(c)
            self._parents.pop(request_id, None)
            self.outputs.drop(request_id)

    async def abort(self, request_ids: list[str]) -> None:
        """Stop requests: their workers free them, their streams end with "abort"."""
        for rid in request_ids:
            parent = self._parents.get(rid)
            if parent is None:
                continue
            for c in parent.children:
                if not c.done and c.worker is not None:
                    await self._send(c.worker, wire.AbortRequest([c.child_id]))
                c.done = True
                self._release(c)
            out = self.outputs.finish(rid, "abort")
            if out is not None:
                parent.queue.put_nowait(_delta(out))

    # -- dispatch -------------------------------------------------------------------------
    def _choose(self, parent: _Parent, exclude: Worker | None = None) -> Worker:
        pool = next(iter(self.layout))
        live = [w for w in self._live(pool) if w is not exclude]
        if not live:
            raise EngineDeadError(f"no live worker in the {pool} pool (restarting); retry "
                                  "shortly")
        return pick(live, [self._load[w] for w in live],
                    [self._prefix[w].match(parent.hashes) for w in live],
                    slack=self.config.max_num_batched_tokens)

    async def _dispatch(self, c: _Child, worker: Worker) -> None:
        """Send a child to a worker (with the tokens it already streamed, if any)."""
        p = c.parent
        emitted = self.outputs.token_ids(c.child_id)
        items = [wire.WireMMItem(it.modality, it.mm_hash, it.offset, it.length,
                                 list(it.grid_thw), wire.tensor_meta(it.pixel_values),
                                 it.second_per_grid_t) for it in p.prompt.mm_items]
        msg = wire.AddRequest(c.child_id, p.prompt.prompt_token_ids, c.params, items, emitted)
        frames = wire.encode(msg, [it.pixel_values for it in p.prompt.mm_items])  # ValueError
        c.worker = worker
        c.cost = len(p.prompt.prompt_token_ids) + (c.params.max_tokens or 0) - len(emitted)
        self._load[worker] += c.cost
        self._prefix[worker].capacity = int(worker.info.get("num_kv_blocks", 1))
        self._prefix[worker].record(p.hashes)
        if not await self._send_frames(worker, frames):
            await self._recover(c, worker)

    async def _send(self, worker: Worker, msg: msgspec.Struct) -> bool:
        return await self._send_frames(worker, wire.encode(msg))

    async def _send_frames(self, worker: Worker, frames: list[bytes]) -> bool:
        """False when the worker is not connected (dead, restarting) or stuck."""
        try:
            await asyncio.wait_for(
                self._sock.send_multipart([worker.identity.encode(), *frames]), SEND_TIMEOUT_S)
            return True
        except (zmq.ZMQError, asyncio.TimeoutError):
            return False

    def _release(self, c: _Child) -> None:
        if c.worker is not None:
            self._load[c.worker] -= c.cost
        c.cost = 0
        self._children.pop(c.child_id, None)

    # -- worker messages --------------------------------------------------------------------
    async def _read_loop(self) -> None:
        while True:
            frames = await self._sock.recv_multipart()
            try:
                self._on_message(frames)
            except Exception:  # a bug here must not stop every request: log, keep reading
                logger.exception("handling a worker message failed")

    def _on_message(self, frames: list[bytes]) -> None:
        ident = frames[0].decode("utf-8", "replace")
        worker = self._by_name.get(ident.partition("#")[0])
        if worker is None or worker.identity != ident or len(frames) < 2:
            return  # an old incarnation's late message, or not one of ours
        try:
            msg = wire.decode_from_worker(frames[1])
        except (msgspec.DecodeError, msgspec.ValidationError):
            logger.error("dropped a malformed message from %s", worker.identity)
            return
        if isinstance(msg, wire.StepOutputs):
            self._on_outputs(worker, msg.outputs)
        elif isinstance(msg, wire.WorkerStats):
            worker.stats = msg.values
        elif isinstance(msg, wire.RequestError):
            self._fail_child(worker, msg.request_id, ValueError(msg.message))
        elif isinstance(msg, wire.Hello):
            worker.state = "up"
            worker.info = {"pid": msg.pid, "max_model_len": msg.max_model_len,
                           "num_kv_blocks": msg.num_kv_blocks}
            logger.info("%s is up (pid %d)", worker.identity, msg.pid)

    def _on_outputs(self, worker: Worker, outs: list[EngineCoreOutput]) -> None:
        mine = []
        for o in outs:
            c = self._children.get(o.request_id)
            if c is not None and c.worker is worker and not c.done:
                mine.append(o)
                if o.finish_reason is not None:
                    c.done = True
                    self._load[worker] -= c.cost
                    c.cost = 0
        results, stopped = self.outputs.process(mine)
        for cid in stopped:  # stop strings: the worker need not go on
            c = self._children.get(cid)
            if c is not None and c.worker is not None:
                c.done = True
                asyncio.ensure_future(self._send(c.worker, wire.AbortRequest([cid])))
        for r in results:
            parent = self._parents.get(r.request_id)
            if parent is not None:
                parent.queue.put_nowait(_delta(r))

    def _fail_child(self, worker: Worker, child_id: str, err: Exception) -> None:
        c = self._children.get(child_id)
        if c is None or c.worker is not worker:
            return
        c.done = True
        for sib in c.parent.children:  # the whole client request fails: free its siblings
            if sib is not c and not sib.done and sib.worker is not None:
                sib.done = True
                asyncio.ensure_future(self._send(sib.worker, wire.AbortRequest([sib.child_id])))
        c.parent.queue.put_nowait(err)

    # -- failures ----------------------------------------------------------------------------
    def _on_worker_exit(self, worker: Worker, code: int) -> None:
        """Supervisor callback: move (or fail) every request the dead worker held."""
        if not self._started:
            self._start_failure = (f"worker {worker.name} exited with code {code} during "
                                   "start-up (see its log above)")
            return
        self._prefix[worker].clear()
        for c in [c for c in self._children.values() if c.worker is worker and not c.done]:
            asyncio.ensure_future(self._recover(c, worker))

    async def _recover(self, c: _Child, dead: Worker) -> None:
        if c.done or c.parent.request_id not in self._parents:
            return
        self._load[dead] -= c.cost
        c.cost, c.worker = 0, None
        if c.migrations >= MAX_MIGRATIONS:
            c.parent.queue.put_nowait(EngineDeadError(
                "the request was on workers that died repeatedly; it was stopped"))
            return
        try:
            target = self._choose(c.parent, exclude=dead)
        except EngineDeadError as e:
            c.parent.queue.put_nowait(EngineDeadError(
                f"the engine process died; {e}"))
            return
        c.migrations += 1
        self.migrations_total += 1
        logger.warning("moving %s from %s to %s after %d streamed tokens", c.child_id,
                       dead.identity, target.identity, len(self.outputs.token_ids(c.child_id)))
        await self._dispatch(c, target)


def _delta(r: RequestOutput) -> wire.RequestDelta:
    comps = []
    for c in r.outputs:
        if not c.token_ids_delta and not c.finished_now and not c.text_delta:
            continue  # nothing new (a finish is reported once)
        lps = None
        if c.logprobs is not None and c.token_ids_delta:
            lps = [{t: lp.logprob for t, lp in d.items()}
                   for d in c.logprobs[-len(c.token_ids_delta):]]
        comps.append(wire.CompletionDelta(c.index, c.text_delta, c.token_ids_delta,
                                          c.finish_reason, c.stop_reason, lps))
    return wire.RequestDelta(r.request_id, comps, r.finished, len(r.prompt_token_ids),
                             r.num_cached_tokens)


__all__ = ["EngineDeadError", "Router"]
