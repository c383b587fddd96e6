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
import time
from typing import Any

from triptych.router.handle import WorkerHandle
from triptych.worker import wire

logger = logging.getLogger("triptych.router")
MAX_POOL_WORKERS = 64
DRAIN_POLL_S = 0.1
STOP_GRACE_S = 10.0


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
