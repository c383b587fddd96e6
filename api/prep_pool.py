"""PrepPool (P0): the preparation processes beside P0, where images and videos are decoded,
processed for the model and written to shared memory (api/prep_proc.py).

    P0 thread (a request's preparation)        pool thread k            process k
    run(job, tenant) -- fair queue (per tenant) --> write Job  ---------->  decode, process,
                     <-- Done, segment adopted <-- read Done  <----------   write segment

The processes start at the first image or video the server gets (all of them at once), not
with the server: a server that serves only text never pays their ~3 s of CPU and ~300 MB
each (torch and the model's processor); the first media item waits for one to come up.
One job per process at a time. While it runs, its process is watched: past the job's
deadline (``--max-image-decode-seconds`` of its CPU time; a video's decode limit plus that;
ten times that in wall time when it gets almost no CPU) or above
``--mm-processor-memory`` of resident memory it is killed, what it had written is removed,
a new process takes its place, and that job alone fails with a 400 naming the flag. The
queue serves tenants in turn, so one tenant's images cannot hold back another's. The
segment a job returns is adopted by P0 (renamed under P0's name: it lives at most as long
as P0) and unlinked when the request that holds it ends (``Prepared.release``, also on
garbage collection).
"""
from __future__ import annotations

import logging
import os
import select
import subprocess
import sys
import threading
import time
import weakref
from collections import deque
from concurrent.futures import CancelledError, Future
from typing import Any

import msgspec
from triptych.api.grammar_proc import read_frame, write_frame
from triptych.api.media.limits import MediaError
from triptych.api.prep_wire import Done, Job, Start
from triptych.mmcache.shm_ring import ShmItemRef
from triptych.mmcache.shm_segment import (
    adopt_segment,
    cleanup_stale_segments,
    segments_of,
    unlink_segment,
)

logger = logging.getLogger("triptych.api")
START_TIMEOUT_S = 120.0  # a process's start (imports torch and transformers)
_POLL_S = 0.05  # how often a running job's process is looked at
_PAGE = os.sysconf("SC_PAGE_SIZE")
_TICK = os.sysconf("SC_CLK_TCK")
STALL_FACTOR = 10  # a job that has had little CPU is still stopped after this x its deadline


class Prepared:
    """One job's pixels in shared memory (one entry, or one per temporal group), owned by
    P0 until ``release`` (or garbage collection) unlinks them."""

    def __init__(self, name: str, refs: list[ShmItemRef]) -> None:
        self.name, self.refs = name, refs
        self._finalizer = weakref.finalize(self, unlink_segment, name)

    def ref(self, group: int | None) -> ShmItemRef:
        return self.refs[group or 0]

    def release(self) -> None:
        self._finalizer()


def _cpu_s(pid: int) -> float:
    """CPU seconds (user + system) the process has used so far; 0 when it is gone."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()  # (the name may hold spaces)
        return (int(fields[11]) + int(fields[12])) / _TICK
    except (OSError, IndexError, ValueError):
        return 0.0


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/statm") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        return 0


class _Proc:
    """One preparation process, started on demand and again after a kill."""

    def __init__(self, start: Start) -> None:
        self.start_msg = start
        self.proc: subprocess.Popen | None = None

    def ensure(self) -> subprocess.Popen:
        if self.proc is not None and self.proc.poll() is None:
            return self.proc
        env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        self.proc = p = subprocess.Popen(
            [sys.executable, "-m", "triptych.api.prep_proc"], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, env=env)
        assert p.stdin is not None and p.stdout is not None
        try:
            write_frame(p.stdin, self.start_msg)
            if not select.select([p.stdout], [], [], START_TIMEOUT_S)[0] or \
                    read_frame(p.stdout, Done) is None:
                raise OSError("no answer")
        except (OSError, ValueError, msgspec.DecodeError):
            self.kill()
            raise MediaError("the media preparation process did not start; see the server "
                             "log") from None
        return p

    def kill(self) -> None:
        p, self.proc = self.proc, None
        if p is None:
            return
        p.kill()
        p.wait()
        for name in segments_of(p.pid):  # what it was writing when it was stopped
            unlink_segment(name)
        for f in (p.stdin, p.stdout):
            if f is not None:
                f.close()


class PrepPool:
    """``workers`` preparation processes; ``run`` may be called from any thread."""

    def __init__(self, model_dir: str, workers: int, deadline_s: float = 10.0,
                 memory_bytes: int = 4 << 30, processor_kwargs: dict[str, Any] | None = None,
                 nice: int = 10) -> None:
        cleanup_stale_segments()  # what a killed P0's preparations left
        start = Start(model_dir, dict(processor_kwargs or {}), nice)
        self.deadline_s, self.memory_bytes = deadline_s, memory_bytes
        self._procs = [_Proc(start) for _ in range(workers)]
        self._queues: dict[str | None, deque[tuple[Job, Future]]] = {}
        self._turn: deque[str | None] = deque()  # tenants with queued jobs, in turn
        self._cv = threading.Condition()
        self._closed = False
        self._wanted = False  # a first job came: every process starts
        self.num_jobs = self.num_killed = self.num_running = 0
        self.cpu_s = 0.0  # CPU the processes spent on jobs
        self._threads = [threading.Thread(target=self._serve, args=(p,), daemon=True,
                                          name=f"triptych-prep-{i}")
                         for i, p in enumerate(self._procs)]
        for t in self._threads:
            t.start()

    @property
    def pids(self) -> list[int]:
        return [p.proc.pid for p in self._procs if p.proc is not None and p.proc.poll() is None]

    def run(self, job: Job, tenant: str | None = None) -> tuple[Done, Prepared | None]:
        """Prepare ``job`` (blocking: call it from a thread). MediaError (a 400) for media
        that cannot be read, or that overran the deadline or the memory limit."""
        fut: Future = Future()
        with self._cv:
            if self._closed:
                raise MediaError("the server is shutting down")
            self._queues.setdefault(tenant, deque()).append((job, fut))
            if tenant not in self._turn:
                self._turn.append(tenant)
            if not self._wanted:  # the first media item: all the processes start now
                self._wanted = True
                self._cv.notify_all()
            else:
                self._cv.notify()
        try:
            return fut.result()
        except CancelledError:
            raise MediaError("the server is shutting down") from None

    def _next(self) -> tuple[Job, Future] | None:
        with self._cv:
            while not self._closed:
                while self._turn:
                    tenant = self._turn.popleft()
                    queue = self._queues[tenant]
                    job = queue.popleft()
                    if queue:
                        self._turn.append(tenant)
                    else:
                        del self._queues[tenant]
                    if job[1].set_running_or_notify_cancel():
                        return job
                self._cv.wait()
        return None

    def _serve(self, proc: _Proc) -> None:
        with self._cv:  # NOTE: started at the first media item, not with the server: a
            while not (self._wanted or self._closed):  # text-only server never pays a
                self._cv.wait()  # process's ~3 s of CPU and ~300 MB (torch, the processor)
        if not self._closed:
            try:
                proc.ensure()  # (all of them at once, so a burst finds them up)
            except MediaError as e:
                logger.error("%s", e)
        while (item := self._next()) is not None:
            job, fut = item
            self.num_running += 1
            try:
                fut.set_result(self._run_one(proc, job))
            except BaseException as e:  # noqa: BLE001 - the caller's to raise
                fut.set_exception(e)
            finally:
                self.num_running -= 1
        proc.kill()

    def _run_one(self, proc: _Proc, job: Job) -> tuple[Done, Prepared | None]:
        p = proc.ensure()
        assert p.stdin is not None and p.stdout is not None
        what = "image" if job.kind == "image" else "video"
        deadline_s = self.deadline_s + (float(job.limits.get("max_video_decode_s", 0))
                                        if job.kind == "video" else 0.0)
        # NOTE: the deadline counts the process's CPU time, not the wall clock: it runs at a
        # lower priority than serving, so on a busy host an innocent photo can wait many
        # seconds for the CPU (a 12 MP one needs ~0.5 s of it); a job that gets little CPU
        # for STALL_FACTOR x the deadline (a stuck decoder) is stopped all the same
        cpu0, stall = _cpu_s(p.pid), time.monotonic() + STALL_FACTOR * deadline_s
        try:
            write_frame(p.stdin, job)
        except OSError:
            pass  # (it died before the job: read_frame sees the end below)
        while True:  # watched until it answers (looked at before the first wait too)
            if _rss(p.pid) > self.memory_bytes:
                self._stopped(proc, f"preparing the {what} took more than "
                                    f"{self.memory_bytes >> 20} MiB of memory "
                                    f"(--mm-processor-memory); send a smaller {what}")
            if _cpu_s(p.pid) - cpu0 > deadline_s or time.monotonic() > stall:
                self._stopped(proc, f"preparing the {what} took longer than {deadline_s:g} "
                                    f"s of CPU (--max-image-decode-seconds); send a smaller "
                                    f"or simpler {what}")
            if select.select([p.stdout], [], [], _POLL_S)[0]:
                break
        try:
            done = read_frame(p.stdout, Done)
        except (OSError, ValueError, msgspec.DecodeError):
            done = None
        if done is None:  # (it died: a decoder crash)
            self._stopped(proc, f"cannot decode {what}: unsupported format or corrupt data")
        self.num_jobs += 1
        self.cpu_s += done.cpu_s
        if done.error is not None:
            raise MediaError(done.error)
        # NOTE: adopted at once (renamed under P0's name): from here the segment lives no
        # longer than P0, and a sweep of the (later killed) process's segments spares it
        name = adopt_segment(done.segment)
        refs = [msgspec.structs.replace(r, segment=name) for r in done.refs]
        return done, Prepared(name, refs)

    def _stopped(self, proc: _Proc, why: str) -> None:
        self.num_killed += 1
        logger.warning("a media preparation process was stopped: %s", why)
        proc.kill()
        raise MediaError(why)

    def stats(self) -> dict[str, float]:
        return {"mm_prep_jobs": float(self.num_jobs), "mm_prep_killed": float(self.num_killed),
                "mm_prep_cpu_seconds": self.cpu_s}

    def close(self) -> None:
        with self._cv:
            self._closed = True
            waiting = [f for q in self._queues.values() for _, f in q]
            self._queues.clear()
            self._turn.clear()
            self._cv.notify_all()
        for f in waiting:
            f.cancel()
        for p in self._procs:
            p.kill()
        for t in self._threads:
            t.join(timeout=10)


__all__ = ["PrepPool", "Prepared"]
