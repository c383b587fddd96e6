"""Elastic pool sizes: grow or shrink a pool while the server runs (POST /admin/pools).

    grow    new worker slots (the next indexes), started by the supervisor like the
            others (a local process, or a Ray actor in its own placement group); they take
            requests once their Hello arrives, as any restarted worker does
    shrink  the highest indexes first: each is marked ``draining`` (routing skips it, its
            requests go on), then, once it holds none (or after ``drain_timeout_s``, when
            what it still holds runs again elsewhere from the tokens already streamed), it
            is asked to stop, killed after a grace period and forgotten

Workers on other hosts (`triptych worker`) are not ours to start or stop: they count
neither way.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from typing import Any

from triptych.router.handle import WorkerHandle
from triptych.worker import wire

logger = logging.getLogger("triptych.router")
MAX_POOL_WORKERS = 64
DRAIN_POLL_S = 0.1
STOP_GRACE_S = 10.0


class NoRoom(ValueError):
    """A grow the host (or Ray cluster) has no room for (HTTP 409)."""


def _rss(pid: int) -> int:
    """Resident bytes of ``pid`` and its descendants (a tensor-parallel group's ranks)."""
    total, todo = 0, [pid]
    while todo:
        p = todo.pop()
        try:
            with open(f"/proc/{p}/status") as f:
                total += next((int(x.split()[1]) << 10 for x in f if x.startswith("VmRSS:")),
                              0)
            for task in os.listdir(f"/proc/{p}/task"):
                with open(f"/proc/{p}/task/{task}/children") as f:
                    todo += [int(c) for c in f.read().split()]
        except (OSError, ValueError):
            continue  # gone meanwhile
    return total


def worker_footprint(w: WorkerHandle) -> int:
    """Bytes one more worker like ``w`` would take: ``w``'s resident memory when it is up
    here, else what its hello and config say (weights + KV budget); 0: unknown."""
    if w.up and w.proc is not None and getattr(w.proc, "pid", None):
        rss = _rss(w.proc.pid)
        if rss:
            return rss
    weights = sum((w.info.get("weight_bytes") or {}).values())
    return weights + int(w.config.get("kv_cache_memory") or 0) if weights else 0


def mem_available() -> int:
    """This host's MemAvailable (bytes): what it can give without swapping."""
    with open("/proc/meminfo") as f:
        return next(int(x.split()[1]) << 10 for x in f if x.startswith("MemAvailable:"))


def check_host_room(pool: str, keep: list[WorkerHandle], count: int) -> None:
    """NoRoom unless ``count`` more workers like the largest of ``keep`` fit in this
    host's MemAvailable with a tenth of it kept spare."""
    each = max((worker_footprint(w) for w in keep), default=0)
    if each <= 0:
        raise NoRoom(f"no {pool} worker is up yet to measure a worker's memory by; grow "
                     "the pool once one is")
    avail = mem_available()
    if each * count > 0.9 * avail:
        raise NoRoom(f"growing the {pool} pool by {count} needs about "
                     f"{each * count / 2**30:.2f} GiB ({each / 2**30:.2f} GiB a worker, "
                     f"measured on a live one) but this host has {avail / 2**30:.2f} GiB "
                     "available (MemAvailable, a tenth kept spare)")


class PoolResizer:
    def __init__(self, router: Any, drain_timeout_s: float = 300.0) -> None:
        """``router``: the started Router (its registry, supervisor, sockets, requests,
        migration and backend)."""
        self.router = router
        self.drain_timeout_s = drain_timeout_s
        self._tasks: set[asyncio.Task] = set()

    def managed(self, pool: str) -> list[WorkerHandle]:
        """The pool's workers this server runs and keeps (not draining, not remote)."""
        return [w for w in self.router.registry.pool(pool)
                if w.remote is None and w.state not in ("draining", "stopped")]

    def resize(self, pool: str, workers: int) -> dict[str, Any]:
        """Set ``pool`` to ``workers`` workers; returns what changed. ValueError for a
        pool the layout lacks or a size out of range."""
        r = self.router
        if pool not in r.layout.pools:
            raise ValueError(f"pool must be one of {', '.join(r.layout.pools)}, not {pool!r}")
        if not isinstance(workers, int) or not 1 <= workers <= MAX_POOL_WORKERS:
            raise ValueError(f"workers must be an integer from 1 to {MAX_POOL_WORKERS}")
        keep = self.managed(pool)
        if not keep:
            raise ValueError(f"the {pool} pool has no worker this server manages")
        if workers > len(keep):
            self._check_room(pool, keep, workers - len(keep))
        added, draining = [], []
        for _ in range(workers - len(keep)):
            index = max(w.index for w in r.registry.pool(pool)) + 1
            w = r.registry.add_local(pool, index, keep[0].config, keep[0].num_threads)
            r.supervisor.spawn(w)
            added.append(w.name)
        for w in sorted(keep, key=lambda w: w.index)[workers:]:
            w.state = "draining"
            draining.append(w.name)
            task = asyncio.get_running_loop().create_task(self._drain(w))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)
        if added or draining:
            logger.info("pool %s: %d -> %d workers (added %s, draining %s)", pool, len(keep),
                        workers, added, draining)
        return {"pool": pool, "workers": workers, "added": added, "draining": draining}

    def _check_room(self, pool: str, keep: list[WorkerHandle], count: int) -> None:
        """NoRoom unless ``count`` more ``pool`` workers fit: on a Ray cluster, their
        bundles in what the cluster has free; on this host, a live worker's footprint
        (its RSS and its ranks', else its weights + KV budget) times ``count`` within
        MemAvailable, keeping a tenth of it spare."""
        r = self.router
        if r.backend is not None:
            import ray
            from triptych.router.ray_backend import pool_bundle

            bundle, _ = pool_bundle(r.config, pool, r.layout.tp[pool])
            free = ray.available_resources()
            short = {k: v * count for k, v in bundle.items() if free.get(k, 0.0) < v * count}
            if short:
                raise NoRoom(f"the Ray cluster has no room for {count} more {pool} workers: "
                             f"they ask {short} in all; free now: "
                             f"{ {k: free.get(k, 0.0) for k in short} }")
            return
        check_host_room(pool, keep, count)

    async def _drain(self, w: WorkerHandle) -> None:
        r = self.router
        deadline = time.monotonic() + self.drain_timeout_s
        try:
            while r.requests.on(w) and time.monotonic() < deadline:
                if w.proc is not None and w.proc.poll() is not None:
                    break  # it died while draining: what it held runs again below
                await asyncio.sleep(DRAIN_POLL_S)
            w.state = "stopped"  # not live: nothing new reaches it, its exit is expected
            if r.requests.on(w):
                logger.warning("%s still held %d requests when its drain ended; they run "
                               "again elsewhere", w.name, len(r.requests.on(w)))
                r.migration.on_worker_exit(w)
            await self._stop(w)
        except Exception:
            logger.exception("draining %s failed", w.name)
        finally:
            with contextlib.suppress(ValueError):
                r.supervisor.workers.remove(w)
            r.registry.remove(w)
            logger.info("%s drained and stopped", w.name)

    async def _stop(self, w: WorkerHandle) -> None:
        r = self.router
        proc = w.proc
        if proc is not None and proc.poll() is None:
            await r._sockets.send(w, wire.Shutdown())
            try:
                await asyncio.to_thread(proc.wait, STOP_GRACE_S)
            except Exception:  # noqa: BLE001 - TimeoutExpired (process or actor)
                proc.kill()
        if r.backend is not None:
            await asyncio.to_thread(r.backend.release, w.name)

    async def close(self) -> None:
        for t in list(self._tasks):
            t.cancel()
