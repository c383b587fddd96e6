"""Supervisor (P0): starts every worker process, watches it, restarts it with backoff.

    spawn(worker)   python -m triptych.<pool>.worker, WorkerSpec as JSON on stdin (no pickle)
    watch()         every WATCH_INTERVAL_S: a worker that exited is reported (on_exit) and
                    restarted after a backoff (0.5 s doubling to 30 s; reset after 60 s up);
                    a worker up but silent (no heartbeat, worker/heartbeat.py) for
                    ``heartbeat_timeout_s`` is frozen, one inside a single step longer than
                    ``max_step_s`` is hung: SIGKILL, then the same path. A failed
                    start (fork EAGAIN, ...) is logged, shown in /health, retried with the
                    backoff; no error stops the watch.
    stop_all()      SIGTERM to every worker, SIGKILL after a grace period, run dir removed

Local workers that share a CUDA device (``gpu``: router/layout.py's GpuShares) start one at
a time: a worker is started once no other is still starting, so each one finds the device
as the previous ones left it (engine/sizing/memory.py refuses a share that is not free), and
prefill / decode workers get their share once the encode workers measured theirs. The CPU
(and Ray, whose actors get GPUs of their own) start every worker at once.

Workers exit by themselves when P0 dies (worker_loop: PDEATHSIG + parent check), so a
kill -9 of the server leaves nothing running. What a killed server could not remove (its
run dir under the temp dir) is removed by the next server at start (``clean_stale``).
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable

import msgspec
from triptych.connector.owner import make_owned_dir, owner_alive, release
from triptych.connector.segments import pid_alive
from triptych.router.errors import ClusterError
from triptych.router.handle import WorkerHandle
from triptych.router.layout import GpuShares
from triptych.worker.loop import WorkerSpec
from triptych.worker.threads import thread_env

logger = logging.getLogger("triptych.supervisor")
WATCH_INTERVAL_S = 0.2
BACKOFF_MIN_S, BACKOFF_MAX_S, STABLE_S = 0.5, 30.0, 60.0
RUN_DIR_PREFIX = "triptych-"
_RUN_DIR_RE = re.compile(r"^triptych-(\d+)-")
POOL_MODULES = {"colocated": "triptych.decode.worker", "decode": "triptych.decode.worker",
                "prefill": "triptych.prefill.worker", "encode": "triptych.encode.worker"}


def clean_stale(tmp: str | None = None) -> list[str]:
    """Remove run dirs of servers that are no longer running (killed with -9): judged by
    the lock their owner holds while it lives (connector/owner.py), not by the pid in the
    name, which may be recycled or belong to another pid namespace."""
    tmp = tmp or tempfile.gettempdir()
    removed = []
    for name in os.listdir(tmp):
        m = _RUN_DIR_RE.match(name)
        path = os.path.join(tmp, name)
        if m and os.path.isdir(path) and not os.path.islink(path) and \
                not owner_alive(path, int(m.group(1)), pid_alive):
            shutil.rmtree(path, ignore_errors=True)
            removed.append(name)
    return removed


_owned: dict[str, int] = {}  # run dir -> the lock fd this process holds on it


def make_run_dir() -> str:
    """A private (0700) dir for this server's sockets, named after its pid, locked while
    this process lives (``remove_run_dir`` when done)."""
    clean_stale()
    path, fd = make_owned_dir(f"{RUN_DIR_PREFIX}{os.getpid()}-")
    _owned[path] = fd
    return path


def remove_run_dir(path: str) -> None:
    shutil.rmtree(path, ignore_errors=True)
    release(_owned.pop(path, None))


class Supervisor:
    def __init__(self, router_address: str, eos_token_id: int | None,
                 on_exit: Callable[[WorkerHandle, int], None], shm_ring: str | None = None,
                 heartbeat_timeout_s: float = 10.0, max_step_s: float = 0.0,
                 launcher: Callable[[WorkerHandle, WorkerSpec], object] | None = None,
                 gpu: GpuShares | None = None) -> None:
        """``launcher(worker, spec)``: starts the worker elsewhere (a Ray actor,
        router/ray_backend.py) and returns a process-like handle; default: a local
        process. ``gpu``: the workers share a CUDA device (start them in turn)."""
        self.launcher = launcher
        self.gpu = gpu
        self._in_turn: list[WorkerHandle] = []  # waiting for the device (state "waiting")
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self.max_step_s = max_step_s  # a step longer than this is hung (0: never)
        self._last_round = 0.0  # monotonic time of the watch's previous round
        self._attentive_since = 0.0  # P0's own loop stalled until then (see check)
        self.errors_total = 0  # errors the watch survived (failed starts included)
        self.last_error = ""  # the latest one (/health)
        self.router_address = router_address
        self.shm_ring = shm_ring  # P0's shared-memory processor cache, if any
        self.eos_token_id = eos_token_id
        self.on_exit = on_exit
        self.workers: list[WorkerHandle] = []
        self.restarts_total = 0
        self._stopping = False

    def spawn(self, w: WorkerHandle) -> None:
        """Start (or restart) a worker's process. Call from the event loop's thread: the
        kernel's parent-death signal follows the thread that started the child."""
        if w not in self.workers:
            self.workers.append(w)
        if self.gpu is not None and w.remote is None and \
                any(x.state == "starting" and x.proc is not None for x in self.workers):
            if w not in self._in_turn:
                self._in_turn.append(w)
            w.state = "waiting"  # NOTE: not up, not dead: check() starts it in its turn
            return
        if self.gpu is not None and not self._set_share(w):
            return
        if w.proc is not None:
            w.incarnation += 1
        spec = WorkerSpec(worker_id=w.identity, pool=w.pool, router_address=self.router_address,
                          config=w.config, eos_token_id=self.eos_token_id,
                          parent_pid=os.getpid(), num_threads=w.num_threads,
                          shm_ring=self.shm_ring)
        if self.launcher is not None:
            w.proc = self.launcher(w, spec)  # type: ignore[assignment]
            w.state, w.started_at, w.info, w.stats = "starting", time.monotonic(), {}, {}
            w.busy_s = 0.0
            logger.info("started %s (%s)", w.identity, type(w.proc).__name__)
            return
        # NOTE: the count is this worker's share, set explicitly: P0's own environment holds
        # the count the CLI chose for P0 (all cores), which thread_env would keep.
        env = thread_env(w.num_threads, os.environ)
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(w.num_threads)
        w.proc = subprocess.Popen([sys.executable, "-m", POOL_MODULES[w.pool]],
                                  stdin=subprocess.PIPE, env=env)
        assert w.proc.stdin is not None
        w.proc.stdin.write(msgspec.json.encode(spec))
        w.proc.stdin.close()
        w.state, w.started_at, w.info, w.stats = "starting", time.monotonic(), {}, {}
        w.busy_s = 0.0
        logger.info("started %s (pid %d)", w.identity, w.proc.pid)

    def _set_share(self, w: WorkerHandle) -> bool:
        """Give ``w`` its share of the device, now that the encode workers before it said
        what they need; False (logged, taken as a failed start) when the shares cannot fit."""
        assert self.gpu is not None
        need = max((x.info.get("gpu_memory_share", 0.0) for x in self.workers
                    if x.pool == "encode" and x.up), default=0.0)
        try:
            share = self.gpu.share(w.pool, need)
        except ValueError as e:
            logger.error("cannot start %s: %s", w.name, e)
            self._note_error(f"starting {w.name}: {e}")
            w.state, w.spawn_error = "dead", str(e)
            self._schedule_restart(w, time.monotonic())
            self.on_exit(w, 1)
            return False
        if share is not None:
            w.config = {**w.config, "gpu_memory_utilization": share}
        return True

    def _next_in_turn(self) -> None:
        """Start the next worker waiting for the device once none is starting."""
        if self._in_turn and not self._stopping and \
                not any(x.state == "starting" and x.proc is not None for x in self.workers):
            w = self._in_turn.pop(0)
            if w.state == "waiting":
                self.spawn(w)

    async def watch(self) -> None:
        """Notice exits and silences, report them, restart after the backoff. Runs until
        cancelled; an error in one round is logged and counted, and the next round runs."""
        while True:
            try:
                self.check(time.monotonic())
            except Exception as e:  # death detection must never stop: log, count, go on
                self._note_error(f"supervisor round failed: {e!r}")
                logger.exception("the supervisor's watch failed one round; it goes on")
            await asyncio.sleep(WATCH_INTERVAL_S)

    def check(self, now: float) -> None:
        """One round of the watch over every worker."""
        # NOTE: if P0's own event loop was blocked (a round came late), the heartbeats of
        # that time wait unread in the socket: silence counts only from when P0 resumed.
        if self._last_round and now - self._last_round > 1.0:
            self._attentive_since = now
        self._last_round = now
        self._next_in_turn()
        for w in self.workers:
            if w.state in ("starting", "up", "stalled") and w.proc and w.proc.poll() is not None:
                code = w.proc.returncode
                w.state = "dead"
                self._schedule_restart(w, now)
                logger.error("%s (pid %d) exited with %s; restarting in %.1f s",
                             w.identity, w.pid, code, w.backoff_s)
                self.on_exit(w, code)
            elif w.state == "up" and w.proc and \
                    now - max(w.last_seen, self._attentive_since) > self.heartbeat_timeout_s:
                w.state = "stalled"  # killed now; the next round reports it like any exit
                logger.error("%s (pid %d) sent no heartbeat for %.1f s (frozen?): killing it",
                             w.identity, w.pid, now - w.last_seen)
                with contextlib.suppress(ProcessLookupError):
                    w.proc.kill()  # NOTE: SIGKILL ends a stopped (SIGSTOP) process too
            elif w.state == "up" and w.proc and self.max_step_s and w.busy_s > self.max_step_s:
                w.state = "stalled"  # heartbeating, but its step never ends: the same path
                logger.error("%s (pid %d) is inside one step for %.0f s (hung?): killing it; "
                             "raise --max-step-seconds if steps this long are expected",
                             w.identity, w.pid, w.busy_s)
                with contextlib.suppress(ProcessLookupError):
                    w.proc.kill()
            elif w.state == "dead" and w.remote is None and not self._stopping \
                    and now >= w.restart_at:
                try:
                    self.spawn(w)
                except (OSError, ClusterError) as e:  # fork EAGAIN, ENOMEM, Ray refused...
                    w.spawn_error = f"{type(e).__name__}: {e}"
                    self._note_error(f"starting {w.name} failed: {w.spawn_error}")
                    w.state = "dead"
                    self._schedule_restart(w, now)
                    logger.error("starting %s failed (%s); trying again in %.1f s", w.name,
                                 w.spawn_error, w.backoff_s)
                    continue
                w.spawn_error = ""
                w.restarts += 1
                self.restarts_total += 1

    def _schedule_restart(self, w: WorkerHandle, now: float) -> None:
        w.failures = 0 if w.spawn_error == "" and now - w.started_at > STABLE_S \
            else w.failures + 1
        w.backoff_s = min(BACKOFF_MAX_S, BACKOFF_MIN_S * 2 ** max(w.failures - 1, 0))
        w.restart_at = now + w.backoff_s

    def _note_error(self, what: str) -> None:
        self.errors_total += 1
        self.last_error = what

    def health(self) -> dict[str, object]:
        """{"state": ok | degraded, "errors_total", "last_error"}: degraded while a worker
        cannot be started (/health)."""
        failing = [w.name for w in self.workers if w.spawn_error]
        return {"state": "degraded" if failing else "ok", "errors_total": self.errors_total,
                "last_error": self.last_error, "failing_to_start": failing}

    async def stop_all(self, grace_s: float = 10.0) -> None:
        """SIGTERM every worker (a clean exit), SIGKILL what is left after ``grace_s``."""
        self._stopping = True
        procs = [w.proc for w in self.workers if w.proc and w.proc.poll() is None]
        for w in self.workers:
            w.state = "stopped"
        for p in procs:
            with contextlib.suppress(ProcessLookupError):
                p.send_signal(signal.SIGTERM)
        # NOTE: polled, not waited on in a thread: at interpreter exit (the offline LLM's
        # atexit close) the default executor takes no new work.
        deadline = time.monotonic() + grace_s
        for p in procs:
            while p.poll() is None and time.monotonic() < deadline:
                await asyncio.sleep(0.02)
            if p.poll() is None:
                logger.warning("pid %d did not stop in %.0f s; killing it", p.pid, grace_s)
                p.kill()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    p.wait(5)

    def kill_all_now(self) -> None:
        """Last resort when no event loop runs any more (interpreter exit)."""
        for w in self.workers:
            if w.proc and w.proc.poll() is None:
                w.proc.kill()
