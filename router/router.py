"""Router (P0): the one interface the HTTP server and the offline LLM use to reach workers.

    submit(request_id, prompt, params) -> async iterator of RequestDelta (ValueError: refused)
    abort([ids]) · alive() · health() · stats() · new_request_id(prefix) · shutdown()

A client request fans out into n children; each child runs through the pools of the layout
(``router/layout.py``) and its token ids come back as StepOutputs, which the OutputProcessor
turns into text. Per layout a child's path is:

    colocated / PD       AddRequest(pixels) -> one worker prefills, encodes and decodes
    E+PD                 AddRequest(no pixels) -> decode worker; EncodeRequest -> encode
                         worker, which sends the embeddings to that decode worker
    P+D / E+P+D          ReserveKV -> decode worker (KVReserved); AddRequest(kv_dest) ->
                         prefill worker (+ EncodeRequest -> encode worker); the prefill
                         worker streams the first token, its KV goes to the decode worker,
                         which streams the rest

Workers are processes started and restarted by the ``Supervisor``; each connects a DEALER to
this router's ROUTER socket with the identity ``<pool>-<index>#<incarnation>``. Every run of
a child on the workers has its own core id (``<child>@<attempt>``), so nothing a previous
attempt left behind (a late output, a late reservation) is taken for the current one.

When a worker a child depends on dies (or a transfer fails), the child runs again on live
workers from the tokens already streamed (greedy outputs equal an undisturbed run); with no
live worker in a pool it needs, the request ends at once with ``EngineDeadError`` (HTTP 503,
or an SSE error event mid-stream). A child whose workers died MAX_MIGRATIONS times is failed
instead: it may be what kills them.
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
from triptych.router.layout import Layout
from triptych.api.processor import ProcessedPrompt
from triptych.router.routing import PrefixIndex, pick
from triptych.router.supervisor import Supervisor, Worker, make_run_dir
from triptych.config import EngineConfig
from triptych.worker import wire
from triptych.engine.block_hash import chain_hashes
from triptych.engine.output_processor import OutputProcessor
from triptych.engine.outputs import EngineCoreOutput, RequestOutput
from triptych.engine.sampling_params import SamplingParams
from triptych.worker.threads import divide_cores

logger = logging.getLogger("triptych.router")
MAX_MIGRATIONS = 2
SEND_TIMEOUT_S = 5.0
REMOTE_TIMEOUT_S = 10.0  # a worker on another host silent this long is taken for dead (its
# heartbeat is its stats, every 0.25 s; a step bounded by max_num_batched_tokens is shorter)
EMBEDDING_INDEX_ENTRY_BYTES = 1 << 20  # rough size of one image's embedding (routing hint)


class EngineDeadError(RuntimeError):
    """No live worker can take, or finish, the request (the server answers 503)."""


class _Retry(Exception):
    """This attempt of a child cannot go on; run it again (counts as a migration)."""


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
    attempt: int = 0
    worker: Worker | None = None  # streams its tokens now (a prefill worker until hand-off)
    decode: Worker | None = None  # P/D: the decode worker that receives its KV
    encode: Worker | None = None  # the encode worker encoding its items (until EncodeDone)
    charges: list[tuple[Worker, int]] = field(default_factory=list)  # queued tokens
    early: list[EngineCoreOutput] = field(default_factory=list)  # decode outputs that came
    # before the prefill worker's hand-off output
    reserved: asyncio.Future | None = None
    pins: list[str] = field(default_factory=list)  # processor-cache ring entries it holds
    migrations: int = 0
    done: bool = False

    @property
    def core_id(self) -> str:
        return f"{self.child_id}@{self.attempt}"

    @property
    def workers(self) -> list[Worker]:
        return [w for w in (self.worker, self.decode, self.encode) if w is not None]


class Router:
    def __init__(self, config: EngineConfig, tokenizer: Any, *, processor: Any | None = None,
                 start_timeout_s: float = 600.0, threads_per_worker: int | None = None) -> None:
        """``processor``: the InputProcessor whose cache index skipped pixels (needed to
        produce them again for a worker that lacks them; None: no processor cache)."""
        from triptych.router.pixel_planner import PixelPlanner
        from triptych.mmcache import processor_cache_bytes

        self.config = config
        self.tokenizer = tokenizer
        self.pixels = PixelPlanner(config.mm_processor_cache_type,
                                   processor_cache_bytes(config.mm_processor_cache_gb), processor)
        self.layout = Layout.from_config(config)
        from triptych.models.tp_plan import check_layout_tp

        check_layout_tp(config)  # a model that cannot split is refused before any process
        self.outputs = OutputProcessor(tokenizer)
        self._start_timeout_s = start_timeout_s
        # Each worker's torch threads: the knob, else this host's cores split between all
        # ranks; a tensor-parallel worker gets its ranks' shares and splits them again.
        ranks = [self.layout.tp[p] for p, n in self.layout.pools.items() for _ in range(n)]
        shares = iter(divide_cores(sum(ranks)))
        self._threads = [sum(next(shares) for _ in range(r)) for r in ranks]
        if threads_per_worker or config.cpu_threads:
            self._threads = [(threads_per_worker or config.cpu_threads) * r for r in ranks]
        self._parents: dict[str, _Parent] = {}
        self._by_core_id: dict[str, _Child] = {}  # the current attempt of each child
        self._children: dict[str, _Child] = {}  # by child id
        self._by_name: dict[str, Worker] = {}
        self._load: dict[Worker, int] = {}
        self._prefix: dict[Worker, PrefixIndex] = {}
        self._embeds: dict[Worker, PrefixIndex] = {}  # mm hashes a worker probably holds
        self._ids = itertools.count()
        self.migrations_total = 0
        self._tasks: list[asyncio.Task] = []
        self._closed = False
        self._started = False
        self._start_failure: str | None = None
        self.supervisor: Supervisor | None = None
        self._remote: zmq.asyncio.Socket | None = None  # workers on other hosts (CURVE)
        self._key_names: dict[str, str] = {}  # public key (z85) -> node name

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
        logger.info("router listening (%s); sockets in %s", self.layout, self._dir)
        self.supervisor = Supervisor(address, self.tokenizer.eos_token_id, self._on_worker_exit,
                                     shm_ring=self.pixels.ring_name)
        config = dataclasses.asdict(self.config)
        threads = iter(self._threads)
        for pool, n in self.layout.pools.items():
            for i in range(n):
                w = Worker(pool, i, dict(config, tensor_parallel_size=self.layout.tp[pool]),
                           next(threads))
                self._load[w] = 0
                self._prefix[w] = PrefixIndex(1)
                self._embeds[w] = PrefixIndex(1)
                self._by_name[w.name] = w
                self.supervisor.spawn(w)
        self._tasks = [asyncio.create_task(self._read_loop(self._sock, remote=False)),
                       asyncio.create_task(self.supervisor.watch())]
        if self.config.worker_address:
            self._open_remote()
        deadline = time.monotonic() + self._start_timeout_s
        while not all(w.state == "up" for w in self.supervisor.workers):
            if self._start_failure or time.monotonic() > deadline:
                await self.shutdown()
                raise EngineDeadError(self._start_failure or "the workers did not start in time")
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
        if self._remote is not None:
            self._remote.close(0)
            self._remote_auth.close()
        self._ctx.term()
        self.pixels.close()
        shutil.rmtree(self._dir, ignore_errors=True)
        from triptych.connector import cleanup_stale
        cleanup_stale()  # segments and sockets of workers that died (their own are gone)

    def _open_remote(self) -> None:
        """The registration socket for workers on other hosts: CURVE only, bound where the
        operator said (worker_address). A worker is known by its key: the name it claims
        must be the name of the public key it authenticated with."""
        from triptych.connector.auth import load_keys, secure_server

        keys = load_keys(self.config.worker_keys, "router")
        self._key_names = {v.decode(): k for k, v in keys.peers.items() if k != "router"}
        self._remote = self._ctx.socket(zmq.ROUTER)
        self._remote.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._remote.setsockopt(zmq.MAXMSGSIZE, wire.MAX_MESSAGE_BYTES)
        self._remote.setsockopt(zmq.LINGER, 0)
        self._remote_auth = secure_server(self._remote, keys,
                                          [k.encode() for k in self._key_names])
        self._remote.bind(self.config.worker_address)
        self._tasks += [asyncio.create_task(self._read_loop(self._remote, remote=True)),
                        asyncio.create_task(self._watch_remote())]
        logger.info("workers on other hosts register at %s (CURVE, %d known keys)",
                    self.config.worker_address, len(self._key_names))

    async def _watch_remote(self) -> None:
        while True:
            now = time.monotonic()
            for w in list(self._by_name.values()):
                if w.remote and w.state == "up" and now - w.last_seen > REMOTE_TIMEOUT_S:
                    w.state = "dead"
                    logger.error("%s (another host) sent nothing for %.0f s; taken for dead",
                                 w.name, REMOTE_TIMEOUT_S)
                    self._on_worker_exit(w, -1)
            await asyncio.sleep(0.5)

    def _register_remote(self, ident: str, msg: wire.Hello) -> Worker | None:
        if msg.pool not in self.layout.pools or msg.worker_id != ident:
            logger.warning("refused %s: pool %r is not in this layout (%s)", ident, msg.pool,
                           self.layout)
            return None
        w = self._by_name.get(ident.partition("#")[0])
        if w is None or w.remote is None:
            index = sum(1 for x in self._by_name.values() if x.pool == msg.pool)
            w = Worker(msg.pool, index, {}, remote=ident)
            self._by_name[w.name] = w
            self._load[w] = 0
            self._prefix[w] = PrefixIndex(1)
            self._embeds[w] = PrefixIndex(1)
            self.supervisor.workers.append(w)
        elif w.remote != ident:  # the same node, restarted: its old requests are gone
            if w.state == "up":
                self._on_worker_exit(w, -1)
            w.remote = ident
            w.restarts += 1
        if w.state != "up":
            logger.info("%s (another host, pool %s) registered", ident, msg.pool)
        w.state = "up"
        return w

    # -- the interface --------------------------------------------------------------------
    def _live(self, pool: str) -> list[Worker]:
        return [w for w in (self.supervisor.workers if self.supervisor else [])
                if w.pool == pool and w.state == "up"]

    def alive(self) -> bool:
        return not self._closed and all(self._live(p) for p in self.layout.pools)

    def health(self) -> dict[str, Any]:
        """{"status": ok | degraded | unavailable, "layout", "pools": {pool: {"live",
        "workers": [{index, pid, state, restarts, requests}]}}}."""
        pools: dict[str, Any] = {}
        for pool in self.layout.pools:
            ws = [w for w in self.supervisor.workers if w.pool == pool] if self.supervisor else []
            pools[pool] = {"live": sum(w.state == "up" for w in ws), "workers": [
                {"index": w.index, "name": w.name, "pid": w.pid, "state": w.state,
                 "restarts": w.restarts, "remote": w.remote is not None, "served": w.served,
                 "requests": sum(1 for c in self._by_core_id.values() if w in c.workers)}
                for w in ws]}
        if self._closed or any(p["live"] == 0 for p in pools.values()):
            status = "unavailable"
        elif any(p["live"] < len(p["workers"]) for p in pools.values()):
            status = "degraded"
        else:
            status = "ok"
        return {"status": status, "layout": str(self.layout), "pools": pools}

    def stats(self) -> dict[str, float]:
        """Every live worker's gauges and counters summed (KV usage averaged), each pool's
        under ``pool/<name>/<key>``, plus the router's own counters."""
        out: dict[str, float] = {}
        for pool in self.layout.pools:
            ws = self._live(pool)
            agg: dict[str, float] = {}
            for w in ws:
                for k, v in w.stats.items():
                    agg[k] = agg.get(k, 0.0) + v
            if ws and "kv_cache_usage_perc" in agg:
                agg["kv_cache_usage_perc"] /= len(ws)
            agg["workers_live"] = len(ws)
            for k, v in agg.items():
                out[f"pool/{pool}/{k}"] = v
                if k != "kv_cache_usage_perc" or pool in ("colocated", "decode"):
                    out[k] = out.get(k, 0.0) + v
        pixel_pool = self.layout.pixel_pool
        for k, v in self.pixels.stats().items():  # P0's processor cache, for its consumers
            out[f"pool/{pixel_pool}/{k}"] = v
            out[k] = v
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
        """Stream a request's deltas (what the HTTP layer sends). Raises ValueError if a
        worker refuses it and EngineDeadError if no live worker can run or finish it."""
        # NOTE: aclosing: a client that goes away closes this generator, and the inner one
        # must run its finally (the abort) now, not whenever the garbage collector gets to it.
        async with contextlib.aclosing(self.outputs_of(request_id, prompt, params,
                                                       stream)) as outs:
            sent_prompt_lps = False
            async for out in outs:
                yield _delta(out, with_prompt_logprobs=not sent_prompt_lps)
                sent_prompt_lps = sent_prompt_lps or out.prompt_logprobs is not None

    async def outputs_of(self, request_id: str, prompt: ProcessedPrompt,
                         params: SamplingParams, stream: bool = True
                         ) -> AsyncIterator[RequestOutput]:
        """Stream a request's RequestOutputs (the offline LLM's view; see ``submit``)."""
        if self._closed:
            raise EngineDeadError("the server is shutting down")
        params.verify()
        wire.encode(wire.AddRequest(request_id, prompt.prompt_token_ids, params))  # ValueError
        parent = _Parent(request_id, prompt, asyncio.Queue())
        kids = self.outputs.add(request_id, prompt.prompt_text, prompt.prompt_token_ids,
                                params, stream)
        self._parents[request_id] = parent
        parent.children = [_Child(cid, sp, parent) for cid, sp in kids]
        finished = False
        try:
            parent.hashes = chain_hashes(prompt.prompt_token_ids, prompt.mm_items,
                                         self.config.block_size)
            for pool in self.layout.pools_for(bool(prompt.mm_items)):
                if not self._live(pool):
                    raise EngineDeadError(f"no live worker in the {pool} pool (restarting); "
                                          "retry shortly")
            for c in parent.children:
                self._by_core_id[c.core_id] = c
                self._children[c.child_id] = c
                asyncio.ensure_future(self._run(c))
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
                if not finished and not c.done:
                    await self._stop(c)
                c.done = True
                self._forget(c)
                self._children.pop(c.child_id, None)
            self._parents.pop(request_id, None)
            self.outputs.drop(request_id)

    async def abort(self, request_ids: list[str]) -> None:
        """Stop requests: their workers free them, their streams end with "abort"."""
        for rid in request_ids:
            parent = self._parents.get(rid)
            if parent is None:
                continue
            for c in parent.children:
                if not c.done:
                    await self._stop(c)
                c.done = True
                self._forget(c)
            out = self.outputs.finish(rid, "abort")
            if out is not None:
                parent.queue.put_nowait(out)

    # -- running a child on the pools -------------------------------------------------------
    async def _run(self, c: _Child) -> None:
        """Start the current attempt of a child; a failure to start retries or fails it."""
        try:
            if self.layout.has_prefill_pool:
                await self._run_disaggregated(c)
            else:
                await self._run_together(c)
        except _Retry as e:
            await self._retry(c, str(e), c.attempt)
        except EngineDeadError as e:
            self._fail(c, e)
        except ValueError as e:  # a value the wire refuses (the request's fault)
            self._fail(c, e)
        except Exception:  # our bug: log it, end this request only
            logger.exception("running %s failed", c.core_id)
            self._fail(c, EngineDeadError("internal error"))

    async def _run_together(self, c: _Child) -> None:
        """colocated / PD / E+PD: one worker prefills and decodes."""
        p = c.parent
        w = self._choose(self.layout.main_pool, p)
        c.worker = w
        self._charge(c, w, len(p.prompt.prompt_token_ids) + (c.params.max_tokens or 0))
        emitted = self.outputs.token_ids(c.child_id)

        def build(items: list[wire.WireMMItem], evicted: list[str] = (), seq: int = 0,
                  encoding: list[str] = ()) -> wire.AddRequest:
            return wire.AddRequest(c.core_id, p.prompt.prompt_token_ids, c.params, items,
                                   emitted, encoding=list(encoding),
                                   cache_evicted=list(evicted), cache_seq=seq)

        await self._send_items(c, w, build)

    async def _run_disaggregated(self, c: _Child) -> None:
        """P+D / E+P+D: reserve KV on a decode worker, then prefill on a prefill worker."""
        p = c.parent
        emitted = self.outputs.token_ids(c.child_id)
        d = self._choose("decode", p)
        c.decode = d
        self._charge(c, d, len(p.prompt.prompt_token_ids) + (c.params.max_tokens or 0))
        c.reserved = asyncio.get_running_loop().create_future()
        meta = [_wire_item(it) for it in p.prompt.mm_items]
        await self._send_or_retry(d, wire.ReserveKV(c.core_id, p.prompt.prompt_token_ids,
                                                    c.params, meta, emitted))
        try:  # the decode worker queues the reservation while it has no room; bounded
            reserved = await asyncio.wait_for(c.reserved, self.config.kv_transfer_timeout + 5)
        except asyncio.TimeoutError:
            raise _Retry(f"{d.name} reserved no KV blocks in time") from None
        if c.done:
            return
        pw = self._choose("prefill", p)
        c.worker = pw
        self._charge(c, pw, len(p.prompt.prompt_token_ids))
        dest = wire.KVDest(d.name, d.info["data_address"], reserved.num_blocks,
                           reserved.num_cached_blocks, list(d.info.get("rank_addresses", [])))

        def build(items: list[wire.WireMMItem], evicted: list[str] = (), seq: int = 0,
                  encoding: list[str] = ()) -> wire.AddRequest:
            return wire.AddRequest(c.core_id, p.prompt.prompt_token_ids, c.params, items,
                                   emitted, dest, list(encoding), list(evicted), seq)

        await self._send_items(c, pw, build)

    async def _send_items(self, c: _Child, target: Worker, build: Any) -> None:
        """Send ``target`` its AddRequest: with the pixels (through the processor cache)
        when it runs the vision tower itself; else without them, plus an EncodeRequest to
        an encode worker for the embeddings ``target`` lacks."""
        mm = c.parent.prompt.mm_items
        if not self.layout.has_encode_pool:
            if not await self.pixels.send(target, mm, self._sources(c.parent, mm), build,
                                          self._send_frames, c.pins):
                raise _Retry(f"{target.name} is not reachable")
            return
        held = self._embeds[target]
        encoding = list(dict.fromkeys(it.mm_hash for it in mm if not held.match([it.mm_hash])))
        # NOTE: recorded now, before any await: a concurrent request with the same image
        # then waits for this encode on the target instead of asking for another one.
        held.capacity = max(16, int(target.info.get("encoder_cache_bytes", 0))
                            // EMBEDDING_INDEX_ENTRY_BYTES)
        held.record(encoding)
        await self._send_or_retry(target, build([_wire_item(it) for it in mm],
                                                encoding=encoding))
        await self._encode(c, target, encoding)

    @staticmethod
    def _sources(parent: _Parent, items: list[Any]) -> list[Any]:
        """Each item's MediaSource (to produce skipped pixels again), or None."""
        by_hash = {it.mm_hash: src for it, src in zip(parent.prompt.mm_items,
                                                       parent.prompt.mm_sources)}
        return [by_hash.get(it.mm_hash) for it in items]

    async def _encode(self, c: _Child, target: Worker, hashes: list[str]) -> None:
        """Ask an encode worker to send ``target`` the embeddings of ``hashes``."""
        if not hashes:
            return
        todo = [it for it in c.parent.prompt.mm_items if it.mm_hash in hashes]
        todo = list({it.mm_hash: it for it in todo}.values())
        e = self._choose("encode", c.parent)
        c.encode = e
        self._charge(c, e, sum(it.grid_thw[0] * it.grid_thw[1] * it.grid_thw[2]
                               for it in todo))  # patches
        address = target.info["data_address"]

        def build(items: list[wire.WireMMItem], evicted: list[str], seq: int
                  ) -> wire.EncodeRequest:
            return wire.EncodeRequest(c.core_id, items, address, evicted, seq)

        if not await self.pixels.send(e, todo, self._sources(c.parent, todo), build,
                                      self._send_frames, c.pins):
            raise _Retry(f"{e.name} is not reachable")

    def _choose(self, pool: str, parent: _Parent, exclude: Worker | None = None) -> Worker:
        live = [w for w in self._live(pool) if w is not exclude]
        if not live:
            raise EngineDeadError(f"no live worker in the {pool} pool (restarting); retry "
                                  "shortly")
        bs = self.config.block_size
        w = pick(live, [self._load[w] for w in live],
                 [self._prefix[w].match(parent.hashes) * bs for w in live])
        if pool != "encode":
            self._prefix[w].capacity = int(w.info.get("num_kv_blocks", 1))
            self._prefix[w].record(parent.hashes)
        return w

    def _charge(self, c: _Child, w: Worker, tokens: int) -> None:
        self._load[w] += tokens
        c.charges.append((w, tokens))

    def _uncharge(self, c: _Child, only: Worker | None = None) -> None:
        keep = []
        for w, n in c.charges:
            if only is None or w is only:
                self._load[w] -= n
            else:
                keep.append((w, n))
        c.charges = keep

    async def _send_or_retry(self, w: Worker, msg: msgspec.Struct,
                             frames: list[bytes] | None = None) -> None:
        if not await self._send_frames(w, wire.encode(msg) + (frames or [])):
            raise _Retry(f"{w.name} is not reachable")

    async def _send(self, worker: Worker, msg: msgspec.Struct) -> bool:
        return await self._send_frames(worker, wire.encode(msg))

    async def _send_frames(self, worker: Worker, frames: list[bytes]) -> bool:
        """False when the worker is not connected (dead, restarting) or stuck."""
        sock = self._remote if worker.remote else self._sock
        try:
            await asyncio.wait_for(
                sock.send_multipart([worker.identity.encode(), *frames]), SEND_TIMEOUT_S)
            return True
        except (zmq.ZMQError, asyncio.TimeoutError):
            return False

    async def _stop(self, c: _Child) -> None:
        """Abort the current attempt on every worker involved (best effort)."""
        for w in c.workers:
            if w.state == "up":
                await self._send(w, wire.AbortRequest([c.core_id]))

    def _forget(self, c: _Child) -> None:
        self._by_core_id.pop(c.core_id, None)
        self._uncharge(c)
        self.pixels.unpin(c.pins)
        c.pins = []
        if c.reserved is not None and not c.reserved.done():
            c.reserved.cancel()
        c.worker = c.decode = c.encode = c.reserved = None
        c.early = []

    async def _retry(self, c: _Child, reason: str, attempt: int, count: bool = True) -> None:
        """Run a child again on live workers, from the tokens it already streamed. Only the
        first of several failures reported for one attempt starts another."""
        if c.done or c.attempt != attempt or c.parent.request_id not in self._parents:
            return
        await self._stop(c)
        self._forget(c)
        if count:
            if c.migrations >= MAX_MIGRATIONS:
                self._fail(c, EngineDeadError(
                    "the request's workers failed repeatedly; it was stopped"))
                return
            c.migrations += 1
            self.migrations_total += 1
        c.attempt += 1
        logger.warning("running %s again (%s) after %d streamed tokens", c.child_id, reason,
                       len(self.outputs.token_ids(c.child_id)))
        self._by_core_id[c.core_id] = c
        await self._run(c)

    def _fail(self, c: _Child, err: Exception) -> None:
        """End the client request: one child failing fails it (its siblings are freed)."""
        parent = c.parent
        for sib in parent.children:
            if not sib.done:
                sib.done = True
                asyncio.ensure_future(self._stop(sib))
        if parent.request_id in self._parents:
            parent.queue.put_nowait(err)

    # -- worker messages --------------------------------------------------------------------
    async def _read_loop(self, sock: zmq.asyncio.Socket, remote: bool) -> None:
        while True:
            frames = await sock.recv_multipart(copy=False)
            try:
                self._on_message(frames, remote)
            except Exception:  # a bug here must not stop every request: log, keep reading
                logger.exception("handling a worker message failed")

    def _on_message(self, frames: list[zmq.Frame], remote: bool) -> None:
        ident = frames[0].bytes.decode("utf-8", "replace")
        if len(frames) < 2:
            return
        try:
            msg = wire.decode_from_worker(frames[1].bytes)
        except (msgspec.DecodeError, msgspec.ValidationError):
            logger.error("dropped a malformed message from %r", ident[:64])
            return
        if remote:  # the claimed name must be the name of the key it authenticated with
            key_name = self._key_names.get(frames[0].get("User-Id") or "")
            if key_name is None or ident.partition("#")[0] != key_name:
                logger.warning("dropped a message from %r: not the holder of that name's key",
                               ident[:64])
                return
            if isinstance(msg, wire.Hello):
                self._register_remote(ident, msg)
        worker = self._by_name.get(ident.partition("#")[0])
        if worker is None or worker.identity != ident or (worker.remote is not None) != remote:
            return  # an old incarnation's late message, or not one of ours
        worker.last_seen = time.monotonic()
        if isinstance(msg, wire.StepOutputs):
            self._on_outputs(worker, msg.outputs)
        elif isinstance(msg, wire.WorkerStats):
            worker.stats = msg.values
        elif isinstance(msg, wire.Hello):
            if worker.state != "up":
                logger.info("%s is up (pid %d)", worker.identity, msg.pid)
            worker.state = "up"
            worker.info = msgspec.structs.asdict(msg)
        else:
            c = self._by_core_id.get(getattr(msg, "request_id", ""))
            if c is not None and not c.done and worker in c.workers:
                self._on_request_message(worker, c, msg)

    def _on_request_message(self, worker: Worker, c: _Child, msg: msgspec.Struct) -> None:
        if isinstance(msg, wire.KVReserved):
            if c.reserved is not None and not c.reserved.done():
                c.reserved.set_result(msg)
        elif isinstance(msg, wire.EncodeDone):
            c.encode = None
            self._uncharge(c, only=worker)
        elif isinstance(msg, wire.NeedEmbeddings):
            self._embeds[worker].discard(msg.mm_hashes)  # its cache let them go
            asyncio.ensure_future(self._encode_or_retry(c, worker, msg.mm_hashes))
        elif isinstance(msg, wire.HandBack):  # preempted where it cannot be recomputed
            asyncio.ensure_future(self._retry(c, f"handed back by {worker.name}", c.attempt,
                                              count=False))
        elif isinstance(msg, wire.RequestError):
            if msg.cache_missing:  # P0 and the worker disagreed: forget, send the pixels
                self.pixels.forget(worker, msg.cache_missing, msg.cache_seq)
                asyncio.ensure_future(self._retry(c, f"{worker.name}: processor cache miss",
                                                  c.attempt, count=False))
            elif msg.retryable:
                asyncio.ensure_future(self._retry(c, f"{worker.name}: {msg.message}",
                                                  c.attempt))
            else:
                self._fail(c, ValueError(msg.message))

    async def _encode_or_retry(self, c: _Child, target: Worker, hashes: list[str]) -> None:
        attempt = c.attempt
        try:
            await self._encode(c, target, hashes)
        except (_Retry, EngineDeadError) as e:
            await self._retry(c, str(e), attempt)

    def _on_outputs(self, worker: Worker, outs: list[EngineCoreOutput]) -> None:
        mine: list[EngineCoreOutput] = []
        for o in outs:
            c = self._by_core_id.get(o.request_id)
            if c is None or c.done:
                continue
            if c.worker is worker:
                mine += self._accept(c, worker, o)
            elif c.decode is worker and c.worker is not None:
                c.early.append(o)  # the decode side overtook the prefill side's hand-off
        results, stopped = self.outputs.process(mine)
        for cid in stopped:  # stop strings: the worker need not go on
            c = self._children.get(cid)
            if c is not None:
                c.done = True
                asyncio.ensure_future(self._stop(c))
                self._uncharge(c)
        for r in results:
            parent = self._parents.get(r.request_id)
            if parent is not None:
                parent.queue.put_nowait(r)

    def _accept(self, c: _Child, worker: Worker, o: EngineCoreOutput) -> list[EngineCoreOutput]:
        """The outputs of one worker output, in the OutputProcessor's terms (child ids)."""
        o = msgspec.structs.replace(o, request_id=c.child_id)
        if o.finish_reason == "handoff":  # the prefill worker is done; the decode one goes on
            self._uncharge(c, only=worker)
            c.worker = c.decode
            early, c.early = c.early, []
            return [msgspec.structs.replace(o, finish_reason=None)] + [
                msgspec.structs.replace(e, request_id=c.child_id) for e in early]
        if o.finish_reason is not None:
            c.done = True
            worker.served += 1
            if c.decode is not None and c.decode is not worker:  # ended before the hand-off
                asyncio.ensure_future(self._send(c.decode, wire.AbortRequest([c.core_id])))
            self._uncharge(c)
        return [o]

    # -- failures ----------------------------------------------------------------------------
    def _on_worker_exit(self, worker: Worker, code: int) -> None:
        """Supervisor callback: run again (or fail) every child the dead worker served."""
        if not self._started:
            self._start_failure = (f"worker {worker.name} exited with code {code} during "
                                   "start-up (see its log above)")
            return
        self._prefix[worker].clear()
        self._embeds[worker].clear()
        asyncio.ensure_future(self.pixels.reset(worker))  # its store restarts empty
        from triptych.connector import cleanup_stale
        cleanup_stale()  # the dead worker's shared-memory segments and socket dir
        for c in [c for c in self._by_core_id.values() if worker in c.workers and not c.done]:
            asyncio.ensure_future(self._retry(c, f"{worker.name} died", c.attempt))


def _wire_item(it: Any) -> wire.WireMMItem:
    """An item without pixels (its embedding is cached or on its way)."""
    return wire.WireMMItem(it.modality, it.mm_hash, it.offset, it.length, list(it.grid_thw),
                           None, it.second_per_grid_t)


def _delta(r: RequestOutput, with_prompt_logprobs: bool = False) -> wire.RequestDelta:
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
    plps = None
    if with_prompt_logprobs and r.prompt_logprobs is not None:
        plps = [None if d is None else {t: lp.logprob for t, lp in d.items()}
                for d in r.prompt_logprobs]
    return wire.RequestDelta(r.request_id, comps, r.finished, len(r.prompt_token_ids),
                             r.num_cached_tokens, plps)


__all__ = ["EngineDeadError", "Router"]
