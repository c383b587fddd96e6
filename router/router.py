"""Router (P0): the one interface the HTTP server and the offline LLM use to reach workers.

    submit(request_id, prompt, params) -> async iterator of RequestDelta (ValueError: refused)
    outputs_of(...) -> async iterator of RequestOutput (the offline LLM's view)
    abort([ids]) · alive() · health() · stats() · new_request_id(prefix) · shutdown()

A client request fans out into n children; each child runs through the pools of the layout
(``router/layout.py``) as attempts, and its token ids come back as StepOutputs, which the
OutputProcessor turns into text. The parts, one concept each:

    handle.py      WorkerHandle: one worker's process, Hello, stats and routing state
    registry.py    the workers (local, and remote ones registering over CURVE); routing
    sockets.py     the router's ROUTER sockets; sending to a worker
    requests.py    client requests, children, attempts (``<child>@<attempt>`` core ids)
    dispatch.py    an attempt's path through the pools (colocated / PD / E+PD / P+D / E+P+D)
    migration.py   attempts ending, running again elsewhere, failing the request
    intake.py      every message from the workers
    supervisor.py  starting, watching and restarting the local worker processes

With no live worker in a pool a request needs, it ends at once with ``EngineDeadError``
(HTTP 503, or an SSE error event mid-stream).
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

from triptych.config import EngineConfig
from triptych.engine.kv.block_hash import chain_hashes
from triptych.engine.outputs import RequestOutput
from triptych.engine.sample.sampling_params import SamplingParams
from triptych.router.dispatch import Dispatcher
from triptych.router.errors import EngineDeadError
from triptych.router.handle import WorkerHandle
from triptych.router.intake import Intake
from triptych.router.layout import Layout
from triptych.router.migration import MAX_MIGRATIONS, Migration
from triptych.router.output_processor import OutputProcessor
from triptych.router.prompt import ProcessedPrompt
from triptych.router.registry import WorkerRegistry
from triptych.router.requests import Child, ClientRequest, RequestTable
from triptych.router.sockets import RouterSockets
from triptych.router.supervisor import Supervisor, make_run_dir, remove_run_dir
from triptych.worker import wire
from triptych.worker.threads import divide_cores

logger = logging.getLogger("triptych.router")


class Router:
    def __init__(self, config: EngineConfig, tokenizer: Any, *, processor: Any | None = None,
                 start_timeout_s: float = 600.0, threads_per_worker: int | None = None) -> None:
        """``processor``: the InputProcessor whose cache index skipped pixels (needed to
        produce them again for a worker that lacks them; None: no processor cache)."""
        from triptych.mmcache import processor_cache_bytes
        from triptych.models.tp_plan import check_layout_tp
        from triptych.router.pixel_planner import PixelPlanner

        self.config = config
        self.tokenizer = tokenizer
        self.pixels = PixelPlanner(config.mm_processor_cache_type,
                                   processor_cache_bytes(config.mm_processor_cache_gb), processor)
        self.layout = Layout.from_config(config)
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
        from triptych.worker.fingerprint import model_fingerprint

        self.registry = WorkerRegistry(
            self.layout, config.block_size, self._on_worker_exit,
            config.worker_heartbeat_timeout,
            model_fingerprint(config.model) if config.worker_address else "")
        self.registry.max_step_s = config.max_step_seconds
        self.requests = RequestTable(self.pixels.unpin)
        self._tasks: list[asyncio.Task] = []
        self._closed = False
        self.first_token_timeouts = 0  # requests failed by --first-token-timeout
        self._started = False
        self._start_failure: str | None = None
        self.supervisor: Supervisor | None = None
        self.migration: Migration | None = None  # these need the sockets (start)
        self._sockets: RouterSockets | None = None
        self._resizer: Any = None  # PoolResizer, once a pool was resized
        self.backend: Any = None  # RayBackend with distributed_executor_backend=ray

    # -- life cycle -----------------------------------------------------------------------
    async def start(self) -> None:
        """Bind the sockets, start every local worker and wait until all said hello."""
        launcher, curve = None, None
        if self.config.distributed_executor_backend == "ray":
            from triptych.router.ray_backend import RayBackend

            self.backend = RayBackend(self.config, self.layout)
            try:
                await asyncio.to_thread(self.backend.connect)  # ClusterError: one line
            except BaseException:
                self._closed = True
                raise
            launcher = self.backend.launch
            curve = (self.backend.host, *self.backend.router_keys())
        self._dir = make_run_dir()
        if self.backend is not None:
            self.backend.note_session(self._dir)
        self._sockets = sockets = RouterSockets(self._dir, curve)
        logger.info("router listening (%s); sockets in %s", self.layout, self._dir)
        streamed = self.outputs.token_ids
        dispatcher = Dispatcher(self.layout, self.config.kv_transfer_timeout, self.registry,
                                sockets, self.pixels, streamed)
        self.migration = Migration(self.requests, dispatcher, sockets, self.pixels, streamed)
        intake = Intake(sockets, self.registry, self.requests, self.migration, self.outputs,
                        self.pixels)
        self.supervisor = Supervisor(sockets.address, self.tokenizer.eos_token_id,
                                     self._on_worker_exit, shm_ring=self.pixels.ring_name,
                                     heartbeat_timeout_s=self.config.worker_heartbeat_timeout,
                                     max_step_s=self.config.max_step_seconds,
                                     launcher=launcher, gpu=self.layout.gpu)
        if self.backend is not None:
            from triptych.router.ray_backend import shutdown_sender

            self.backend.send_shutdown = shutdown_sender(
                asyncio.get_running_loop(), lambda w: sockets.send(w, wire.Shutdown()))
        config = dataclasses.asdict(self.config)
        threads = iter(self._threads)
        for pool, n in self.layout.pools.items():
            for i in range(n):
                self.supervisor.spawn(self.registry.add_local(
                    pool, i, dict(config, **self.layout.worker_knobs(pool)),
                    next(threads)))
        self._tasks = [asyncio.create_task(intake.read_loop(sockets.local, remote=False)),
                       asyncio.create_task(self.supervisor.watch())]
        if self.config.worker_address:
            sockets.open_remote(self.config.worker_address, self.config.worker_keys)
            self._tasks += [asyncio.create_task(intake.read_loop(sockets.remote, remote=True)),
                            asyncio.create_task(self.registry.watch_remote())]
        deadline = time.monotonic() + self._start_timeout_s
        while not all(w.up for w in self.supervisor.workers):
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
        for r in list(self.requests.requests.values()):
            r.queue.put_nowait(EngineDeadError("the server is shutting down"))
        if self._resizer is not None:
            await self._resizer.close()
        if self.supervisor:
            await self.supervisor.stop_all()
        if self.backend is not None:
            await asyncio.to_thread(self.backend.close)  # actors, placement groups, Ray
        self.registry.stop_remote()
        for t in self._tasks:
            t.cancel()
        for t in self._tasks:
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await t
        if self._sockets is not None:
            self._sockets.close()
        self.pixels.close()
        remove_run_dir(self._dir)
        from triptych.connector import cleanup_stale
        cleanup_stale()  # segments and sockets of workers that died (their own are gone)

    def _on_worker_exit(self, worker: WorkerHandle, code: int) -> None:
        """A worker died (supervisor, or a silent remote one): its attempts run again."""
        if not self._started:
            self._start_failure = (f"worker {worker.name} exited with code {code} during "
                                   "start-up (see its log above)")
            return
        assert self.migration is not None
        self.migration.on_worker_exit(worker)

    # -- the interface --------------------------------------------------------------------
    async def resize_pool(self, pool: str, workers: int) -> dict[str, Any]:
        """Grow or shrink ``pool`` to ``workers`` (router/elastic.py); ValueError if the
        request is not possible."""
        if not self._started or self._closed:
            raise EngineDeadError("the router is not running")
        if self._resizer is None:
            from triptych.router.elastic import PoolResizer
            self._resizer = PoolResizer(self)
        return self._resizer.resize(pool, workers)

    def pool_sizes(self) -> dict[str, int]:
        """Each pool's workers, draining ones not counted."""
        return {p: sum(w.state not in ("draining", "stopped") for w in self.registry.pool(p))
                for p in self.layout.pools}

    def alive(self) -> bool:
        return not self._closed and all(self.registry.live(p) for p in self.layout.pools)

    def health(self) -> dict[str, Any]:
        """{"status": ok | degraded | unavailable, "layout", "pools": {pool: {"live",
        "workers": [{index, name, pid, state, restarts, remote, served, requests,
        silent_s, busy_s, start_error, weights}]}}, "stalled": [names], "slow_steps": [names],
        "supervisor": {state, errors_total, last_error, failing_to_start}}: ``served``
        counts the requests a worker did its part of (encoded, prefilled or finished),
        ``requests`` the ones it holds now, ``silent_s`` the seconds since its last
        heartbeat, ``busy_s`` how long its current step has run. ``stalled``: workers
        taken for frozen (being killed); ``slow_steps``: live workers inside one step for
        longer than the heartbeat timeout (shown, not killed: a big image can take that).
        ``weights``: {"parts": all | vision | language, "bytes": {"vision", "language"}
        of its process, "ranks": each rank's of a group}, measured at load (its hello)."""
        pools: dict[str, Any] = {}
        now = time.monotonic()
        for pool in self.layout.pools:
            ws = self.registry.pool(pool)
            pools[pool] = {"live": sum(w.up for w in ws), "workers": [
                {"index": w.index, "name": w.name, "pid": w.pid, "state": w.state,
                 "restarts": w.restarts, "remote": w.remote is not None, "served": w.served,
                 "requests": len(self.requests.on(w)),
                 "silent_s": round(now - w.last_seen, 1) if w.up else None,
                 "busy_s": round(w.busy_s, 1), "start_error": w.spawn_error or None,
                 "node": getattr(w.proc, "node", None),
                 "weights": w.weights}
                for w in ws]}
        stalled = [w.name for w in self.registry.workers if w.state == "stalled"]
        slow = [w.name for w in self.registry.workers
                if w.up and w.busy_s > self.config.worker_heartbeat_timeout]
        supervisor = self.supervisor.health() if self.supervisor else {"state": "ok"}
        if self._closed or any(p["live"] == 0 for p in pools.values()):
            status = "unavailable"
        elif supervisor["state"] != "ok" or any(
                p["live"] < sum(w["state"] != "draining" for w in p["workers"])
                for p in pools.values()):
            status = "degraded"
        else:
            status = "ok"
        return {"status": status, "layout": str(self.layout), "pools": pools,
                "stalled": stalled, "slow_steps": slow, "supervisor": supervisor}

    def stats(self) -> dict[str, float]:
        """Every live worker's gauges and counters summed (KV usage averaged), each pool's
        under ``pool/<name>/<key>``, plus the router's own counters."""
        out: dict[str, float] = {}
        for pool in self.layout.pools:
            ws = self.registry.live(pool)
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
        out["first_token_timeouts_total"] = self.first_token_timeouts
        return out

    def new_request_id(self, prefix: str) -> str:
        """A fresh response id, random as vLLM's: a counter would let one tenant count
        the others' requests."""
        return f"{prefix}-{uuid.uuid4().hex}"

    @property
    def num_in_flight(self) -> int:
        return len(self.requests.requests)

    async def submit(self, request_id: str, prompt: ProcessedPrompt, params: SamplingParams,
                     stream: bool = True) -> AsyncIterator[wire.RequestDelta]:
        """Stream a request's deltas (what the HTTP layer sends). Raises ValueError if a
        worker refuses it and EngineDeadError if no live worker can run or finish it."""
        # NOTE: aclosing: a client that goes away closes this generator, and the inner one
        # must run its finally (the abort) now, not whenever the garbage collector gets to it.
        async with contextlib.aclosing(self.outputs_of(request_id, prompt, params, stream,
                                                       deltas_only=True)) as outs:
            sent_prompt_lps = False
            first = await self._first_output(outs)
            if first is None:
                return
            out: RequestOutput | None = first
            while out is not None:
                yield _delta(out, with_prompt_logprobs=not sent_prompt_lps)
                sent_prompt_lps = sent_prompt_lps or out.prompt_logprobs is not None
                out = await anext(outs, None)

    async def _first_output(self, outs: AsyncIterator[RequestOutput]) -> RequestOutput | None:
        """The first output (the first token), within --first-token-timeout. Past it the
        wait is cancelled: the generator's clean-up aborts the request on its workers."""
        timeout = self.config.first_token_timeout
        # NOTE: not wait_for, which (3.11) swallows a cancel arriving with the first token
        first = asyncio.ensure_future(anext(outs, None))
        try:
            await asyncio.wait({first}, timeout=timeout or None)
        finally:
            if not first.done():  # timed out, or we are cancelled
                first.cancel()
                await asyncio.wait({first})
        if not first.cancelled():
            return first.result()
        self.first_token_timeouts += 1
        logger.error("no first token for a request in %.0f s: failed "
                     "(--first-token-timeout)", timeout)
        raise EngineDeadError(
            f"no first token within {timeout:.0f} s (--first-token-timeout): the "
            "workers are overloaded or stuck; retry later")

    async def outputs_of(self, request_id: str, prompt: ProcessedPrompt,
                         params: SamplingParams, stream: bool = True,
                         deltas_only: bool = False) -> AsyncIterator[RequestOutput]:
        """A request's RequestOutputs (the offline LLM's view; see ``submit``; ``stream``,
        ``deltas_only``: ``OutputProcessor.add``'s)."""
        if self._closed or self.migration is None:
            raise EngineDeadError("the server is shutting down" if self._closed else
                                  "the router is not started")
        params.verify()
        wire.encode(wire.AddRequest(request_id, prompt.prompt_token_ids, params))  # ValueError
        request = ClientRequest(request_id, prompt, asyncio.Queue())
        kids = self.outputs.add(request_id, prompt.prompt_text, prompt.prompt_token_ids,
                                params, stream, deltas_only=deltas_only)
        self.requests.add(request, [Child(cid, sp, request) for cid, sp in kids])
        finished = False
        try:
            request.hashes = chain_hashes(prompt.prompt_token_ids, prompt.mm_items,
                                          self.config.block_size, salt=params.cache_salt)
            for pool in self.layout.pools_for(bool(prompt.mm_items)):
                if not self.registry.live(pool):
                    raise EngineDeadError(f"no live worker in the {pool} pool (restarting); "
                                          "retry shortly")
            for c in request.children:
                self.migration.start(c)
            while True:
                item = await request.queue.get()
                if isinstance(item, Exception):
                    finished = True
                    raise item
                yield item
                if item.finished:
                    finished = True
                    return
        finally:
            for c in request.children:  # NOTE: a client that went away: stop its workers
                self.migration.finish(c, abort=None if not finished else [])
            self.requests.drop(request)
            self.outputs.drop(request_id)

    async def abort(self, request_ids: list[str]) -> None:
        """Stop requests: their workers free them, their streams end with "abort"."""
        for rid in request_ids:
            request = self.requests.requests.get(rid)
            if request is None:
                continue
            for c in request.children:
                self.migration.finish(c)
            out = self.outputs.finish(rid, "abort")
            if out is not None:
                request.queue.put_nowait(out)

    @property
    def migrations_total(self) -> int:
        """Attempts that ended because a worker failed them (request_migrations_total)."""
        return self.migration.migrations_total if self.migration else 0


def _delta(r: RequestOutput, with_prompt_logprobs: bool = False) -> wire.RequestDelta:
    comps = []
    for c in r.outputs:
        if not c.token_ids_delta and not c.finished_now and not c.text_delta:
            continue  # nothing new (a finish is reported once)
        lps = (c.logprobs_delta or None) if c.token_ids_delta else None  # (plain dicts, or
        if lps and c.logprobs is not None:  # Logprobs where not registered for deltas only)
            lps = [{t: lp.logprob for t, lp in d.items()} for d in lps]
        comps.append(wire.CompletionDelta(c.index, c.text_delta, c.token_ids_delta,
                                          c.finish_reason, c.stop_reason, lps))
    plps = None
    if with_prompt_logprobs and r.prompt_logprobs is not None:
        plps = [None if d is None else {t: lp.logprob for t, lp in d.items()}
                for d in r.prompt_logprobs]
    return wire.RequestDelta(r.request_id, comps, r.finished, len(r.prompt_token_ids),
                             r.num_cached_tokens, plps)


__all__ = ["MAX_MIGRATIONS", "EngineDeadError", "Router"]

