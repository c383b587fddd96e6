"""KV send lanes: a prefill worker's outgoing KV messages leave on threads, never on its loop.

    loop (KVSender)                          lane of one decode peer (a thread)
      pin the blocks (a reference each)  ->  queue (at most LANE_DEPTH messages)
      submit(job); never waits               -> read the pinned blocks, connector.send
      done(): unpin, report failures     <-  finished jobs (ok, or the error)

One lane (thread, bounded queue) per decode peer address (ended after IDLE_LANE_S with
nothing to send: remote peers come and go), so a frozen or dead peer holds
up only its own messages: a send that times out marks the peer gone for DEAD_PEER_S and
every message queued or submitted to it meanwhile fails at once, without waiting.
A full lane refuses the job (``submit`` returns False); the loop keeps the blocks and
tries again on a later round. The blocks a job reads stay pinned (a reference taken by
the loop) until the loop sees the job done, so none is freed or reused while it is read.
Nothing here touches the block pool: pinning and unpinning are the loop's.
"""
from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from triptych.connector import Connector, ConnectorError, SendTimeout
from triptych.worker import wire

logger = logging.getLogger("triptych.prefill")
LANE_DEPTH = 8  # messages queued per decode peer before the loop holds more back
DEAD_PEER_S = 10.0  # a decode peer that timed out is skipped this long
IDLE_LANE_S = 120.0  # a lane with nothing to send for this long ends (peers come and go)


@dataclass(eq=False)
class KVJob:
    """One KV message to one decode peer."""

    address: str
    header: wire.KVTransfer
    block_ids: list[int]  # read by the lane (pinned until the loop takes the job back)
    data: torch.Tensor | None = None  # already read on the loop (tensor-parallel groups)
    pinned: list[Any] = field(default_factory=list)  # the KVBlocks the loop holds for it
    cancelled: bool = False  # set by the loop: the lane skips it
    error: str | None = None
    nbytes: int = 0
    seconds: float = 0.0


class _Lane:
    def __init__(self, owner: SendLanes, address: str) -> None:
        self.owner, self.address = owner, address
        self.queue: queue.Queue[KVJob | None] = queue.Queue(LANE_DEPTH)
        self.pending = 0  # jobs submitted and not finished (under the owner's lock)
        self.last_used = time.monotonic()
        self.thread = threading.Thread(target=self._run, name="kv-lane", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while (job := self.queue.get()) is not None:
            try:
                self.owner.send_one(job)
            except Exception as e:  # our bug: the job fails, the lane goes on
                logger.exception("KV send to %s failed", self.address)
                job.error = f"internal error: {e}"
            finally:
                self.owner.finished(job, self)


class SendLanes:
    def __init__(self, connector: Connector, read: Callable[[list[int]], torch.Tensor],
                 empty: Callable[[], torch.Tensor]) -> None:
        """``read(block ids)``: the blocks' KV (a host copy); ``empty()``: a message with
        no blocks (a lease renewal)."""
        self.connector, self.read, self.empty = connector, read, empty
        self._lanes: dict[str, _Lane] = {}
        self._dead: dict[str, float] = {}  # address -> monotonic time it may be tried again
        self._done: collections.deque[KVJob] = collections.deque()
        self._cv = threading.Condition()
        self._in_flight = 0
        self._closed = False

    def dead(self, address: str) -> bool:
        return self._dead.get(address, 0.0) > time.monotonic()

    def submit(self, job: KVJob) -> bool:
        """Queue a job on its peer's lane; False (nothing queued) when that lane is full."""
        if self._closed:
            raise ConnectorError("the KV sender is closed")
        lane = self._lanes.get(job.address)
        if lane is None:
            lane = self._lanes[job.address] = _Lane(self, job.address)
        with self._cv:
            self._in_flight += 1
            lane.pending += 1
        lane.last_used = time.monotonic()
        try:
            lane.queue.put_nowait(job)
        except queue.Full:
            with self._cv:
                self._in_flight -= 1
                lane.pending -= 1
            return False
        return True

    def retire_idle(self, now: float) -> None:
        """End the lanes of peers nothing was sent to for IDLE_LANE_S (the loop's thread:
        the only one that submits, so an idle lane stays idle until it is gone)."""
        for address, lane in list(self._lanes.items()):
            with self._cv:
                idle = lane.pending == 0 and now - lane.last_used > IDLE_LANE_S
            if idle:
                del self._lanes[address]
                lane.queue.put_nowait(None)

    def send_one(self, job: KVJob) -> None:
        """On a lane: read and send one job (or fail it at once: cancelled, peer gone)."""
        if job.cancelled:
            job.error = "cancelled"
            return
        if self.dead(job.address):
            job.error = "the decode worker took no KV lately (taken for gone)"
            return
        t0 = time.perf_counter()
        data = job.data
        if data is None:
            data = self.read(job.block_ids) if job.block_ids else self.empty()
        try:
            job.nbytes = self.connector.send(job.address, job.header, [data])
        except SendTimeout as e:
            self._dead[job.address] = time.monotonic() + DEAD_PEER_S
            job.error = str(e)
            return
        except (ConnectorError, ValueError) as e:
            job.error = str(e)
            return
        self._dead.pop(job.address, None)
        job.seconds = time.perf_counter() - t0

    def finished(self, job: KVJob, lane: _Lane) -> None:
        with self._cv:
            self._done.append(job)
            self._in_flight -= 1
            lane.pending -= 1
            self._cv.notify_all()

    def done(self) -> list[KVJob]:
        """Jobs finished since the last call (the loop unpins their blocks)."""
        out = []
        while self._done:
            out.append(self._done.popleft())
        return out

    def wait_idle(self, timeout_s: float) -> bool:
        """Wait until no job is queued or being sent (tests, shutdown); False on timeout."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while self._in_flight:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cv.wait(left)
        return True

    def close(self, timeout_s: float = 1.0) -> None:
        """Stop the lanes (queued jobs are dropped unsent). A lane inside a send ends with
        that send's timeout; it is a daemon thread and never holds the process."""
        self._closed = True
        for lane in self._lanes.values():
            while True:
                try:
                    lane.queue.get_nowait()
                except queue.Empty:
                    break
            try:
                lane.queue.put_nowait(None)
            except queue.Full:
                pass
        deadline = time.monotonic() + timeout_s
        for lane in self._lanes.values():
            lane.thread.join(max(0.0, deadline - time.monotonic()))
