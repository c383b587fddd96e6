"""KVSender: a prefill worker's outgoing KV, block by block, as the prompt's chunks finish.

    request blocks:  [0 .. cached) [cached .......... full) [full .. n)
                      decode side   sent after each step     sent at hand-off with the
                      holds these   once their KV is final   first token (final=True)

A long prompt's blocks leave while later chunks are still being computed; blocks the
decode worker's prefix cache already holds (``num_cached_blocks`` from its reservation) are
never sent. One message carries a run of blocks of every layer:
``[num_layers, 2 (k, v), n, block_size, num_kv_heads, head_dim]``, at most
MAX_KV_MESSAGE_BYTES of them (a long run, e.g. after a long prefix-cache miss on the decode
side, goes as several messages).

The loop never waits on a decode peer: messages go to that peer's send lane (a thread with
a bounded queue, ``kv_lanes.py``), with their blocks pinned until the lane is done with
them; results come back on later rounds (``after_step``/``keepalive`` return the requests
whose transfer failed). A frozen or dead peer costs its own lane one send timeout; the
transfers queued to it then fail at once (the router runs those requests again) and the
prefill of requests bound elsewhere goes on meanwhile.

Under load the decode side's lease (kv_transfer_timeout) must not run out while the request
waits here: every request not heard of for a quarter of the lease gets an empty chunk
(``keepalive``), which renews it; a prefill worker that dies stops renewing, so a leaked
reservation still ends.
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass, field

import torch
from triptych.connector import Connector
from triptych.engine.engine_core import EngineCore
from triptych.engine.outputs import EngineCoreOutput
from triptych.prefill.kv_lanes import DEAD_PEER_S, KVJob, SendLanes
from triptych.worker import wire

logger = logging.getLogger("triptych.prefill")
MAX_KV_MESSAGE_BYTES = 256 << 20  # one KV message at most (the connector's cap is 1 GiB)
__all__ = ["DEAD_PEER_S", "MAX_KV_MESSAGE_BYTES", "KVSender"]


@dataclass
class _Outgoing:
    dest: wire.KVDest
    next_block: int  # first block not queued yet
    last_sent: float  # monotonic time of its last message (or of its arrival): keepalives
    jobs: list[KVJob] = field(default_factory=list)  # queued or being sent
    first_token: int | None = None  # set at hand-off: the rest goes with final=True
    final_queued: bool = False


class KVSender:
    def __init__(self, core: EngineCore, connector: Connector, lease_s: float = 30.0) -> None:
        """``lease_s``: the decode side's lease (kv_transfer_timeout) this sender renews."""
        self.core, self.connector = core, connector
        self.keepalive_s = lease_s / 4
        self._out: dict[str, _Outgoing] = {}
        self.lanes = SendLanes(connector, core.runner.read_blocks, self._empty)
        self.keepalives = 0
        self.bytes_sent = 0
        self.seconds = 0.0
        self.transfers = 0  # requests whose KV was handed over in full
        self.sliced = 0  # messages whose KV went rank to rank (tensor-parallel groups)
        self.held_back = 0  # messages kept for a later round: their peer's lane was full

    @property
    def num_outgoing(self) -> int:
        """Requests whose KV is still to send (0 once none is in flight)."""
        return len(self._out)

    def add(self, request_id: str, dest: wire.KVDest) -> None:
        self._out[request_id] = _Outgoing(dest, dest.num_cached_blocks, time.monotonic())

    def cancel(self, request_id: str) -> None:
        o = self._out.pop(request_id, None)
        for job in o.jobs if o else ():
            job.cancelled = True  # its blocks stay pinned until its lane lets it go
        if request_id in self.core.kv.handed_off:
            self.core.kv.release_blocks(request_id)

    def keepalive(self, now: float) -> list[str]:
        """Every loop round: take back finished sends, queue what waited for room, and
        renew the lease of every request not sent anything for a while (an empty chunk).
        Returns request ids whose transfer failed."""
        failed = self._collect()
        self.lanes.retire_idle(now)
        for rid, o in list(self._out.items()):
            if rid not in self._out:
                continue
            if o.first_token is not None:
                self._pump(rid, o, failed)
            elif not o.jobs and now - o.last_sent >= self.keepalive_s and \
                    self._queue(rid, o, [], o.next_block, False, failed):
                o.last_sent = now
                self.keepalives += 1
        return failed

    def after_step(self, outs: list[EngineCoreOutput]) -> list[str]:
        """Queue what this step completed. Returns request ids whose transfer failed."""
        failed = self._collect()
        handed = {o.request_id: o for o in outs if o.finish_reason == "handoff"}
        for rid, o in list(self._out.items()):
            if rid not in self._out:
                continue
            if rid in handed:
                o.first_token = handed[rid].new_token_ids[-1]
            elif o.first_token is None and rid not in self.core.scheduler.requests:
                del self._out[rid]  # ended without a hand-off (EOS first, abort, error)
                continue
            self._pump(rid, o, failed)
        return failed

    def settle(self, timeout_s: float = 30.0) -> list[str]:
        """Queue and send everything handed off, wait until nothing is being sent, and take
        the results (tests, shutdown)."""
        deadline = time.monotonic() + timeout_s
        failed: list[str] = []
        while True:
            self.lanes.wait_idle(max(0.0, deadline - time.monotonic()))
            failed += self._collect()
            waiting = [(rid, o) for rid, o in self._out.items()
                       if o.first_token is not None and not o.final_queued]
            if not waiting or time.monotonic() > deadline:
                return failed
            for rid, o in waiting:
                self._pump(rid, o, failed)

    def close(self) -> None:
        self.lanes.close(self.connector_timeout_s() + 1.0)

    def connector_timeout_s(self) -> float:
        return getattr(self.connector, "send_timeout_ms", 5000) / 1000

    # -- queueing ----------------------------------------------------------------------
    def _pump(self, rid: str, o: _Outgoing, failed: list[str]) -> None:
        """Queue the request's blocks that are ready: full ones while it runs, all of them
        (the last message final) once handed off."""
        try:
            if o.first_token is not None:
                if o.final_queued:
                    return
                blocks = self.core.kv.handed_off.get(rid, [])
                if len(blocks) < o.dest.num_blocks:
                    raise ValueError(f"{len(blocks)} blocks computed, {o.dest.num_blocks} "
                                     "expected")
                if self._queue_run(rid, o, blocks, o.dest.num_blocks, True, failed):
                    o.final_queued = True
                    self.core.kv.release_blocks(rid)  # the jobs' pins hold them until sent
                return
            req = self.core.scheduler.requests.get(rid)
            if req is None:
                return
            full = min(req.num_computed_tokens // self.core.config.block_size,
                       o.dest.num_blocks)
            self._queue_run(rid, o, self.core.kv.req_blocks.get(rid, []), full, False, failed)
        except ValueError as e:
            self._fail(rid, o, str(e), failed)

    def _queue_run(self, rid: str, o: _Outgoing, blocks: list, upto: int, final: bool,
                   failed: list[str]) -> bool:
        """Blocks [next_block, upto) in messages of at most MAX_KV_MESSAGE_BYTES; True when
        all of them (and the final one) are queued."""
        if upto <= o.next_block and not final:
            return True
        per = max(1, MAX_KV_MESSAGE_BYTES // self._block_bytes())
        start = o.next_block
        while True:
            end = min(upto, start + per)
            last = end >= upto
            if not self._queue(rid, o, blocks[start:end], start, final and last, failed):
                return False
            start = o.next_block = end
            if last:
                return True

    def _queue(self, rid: str, o: _Outgoing, run: list, first_block: int, final: bool,
               failed: list[str]) -> bool:
        """One message: ``run`` (KVBlocks, maybe none) from ``first_block`` on. False when
        it must wait (its lane is full) or the transfer failed."""
        address = o.dest.address
        if self.lanes.dead(address):
            self._fail(rid, o, f"{o.dest.worker} did not take KV lately (taken for gone)",
                       failed)
            return False
        ids = [b.block_id for b in run]
        token = o.first_token if final and o.first_token is not None else -1
        job = KVJob(address, wire.KVTransfer(rid, first_block, final, token, False), ids)
        group = self.core.group
        if group is not None:  # reading is a collective of the group: here, on the loop
            # Groups of the same size: every rank sends its own heads to its counterpart
            # (parallel/kv.py); rank 0's go with the header. Else all heads, gathered here.
            # NOTE: the ranks' slices leave synchronously (a limit, docs/liveness.md).
            runner = self.core.runner
            sliced = len(o.dest.rank_addresses) == group.size
            if sliced and ids and not runner.send_slices(ids, o.dest.rank_addresses[1:], rid,
                                                         first_block):
                self._fail(rid, o, "a tensor-parallel rank could not send its KV slice",
                           failed)
                return False
            job.header = wire.KVTransfer(rid, first_block, final, token, sliced)
            if ids:
                job.data = runner.local_blocks(ids) if sliced else runner.read_blocks(ids)
            else:  # rank 0's heads only when sliced
                shape = runner.kv_caches[0][0].shape[1:] if sliced else runner.kv_block_shape
                job.data = torch.empty((len(runner.kv_caches), 2, 0, *shape),
                                       dtype=runner.kv_caches[0][0].dtype)
        else:
            self.core.kv.pool.touch(run)  # pinned until the lane is done with them
            job.pinned = list(run)
        if not self.lanes.submit(job):
            self._unpin(job)
            self.held_back += 1
            return False
        o.jobs.append(job)
        return True

    # -- results -----------------------------------------------------------------------
    def _collect(self) -> list[str]:
        failed: list[str] = []
        group = self.core.group
        for job in self.lanes.done():
            self._unpin(job)
            rid = job.header.request_id
            o = self._out.get(rid)
            if o is None or job not in o.jobs:
                continue  # cancelled meanwhile
            o.jobs.remove(job)
            if job.error is not None:
                self._fail(rid, o, job.error, failed)
                continue
            self.bytes_sent += job.nbytes * (group.size if job.header.sliced else 1)
            self.seconds += job.seconds
            self.sliced += job.header.sliced
            o.last_sent = time.monotonic()
            if job.header.final:
                del self._out[rid]
                self.transfers += 1
        return failed

    def _fail(self, rid: str, o: _Outgoing, why: str, failed: list[str]) -> None:
        logger.error("KV transfer of %s to %s failed: %s", rid, o.dest.worker, why)
        self.cancel(rid)
        failed.append(rid)

    def _unpin(self, job: KVJob) -> None:
        if job.pinned:
            self.core.kv.pool.free(list(reversed(job.pinned)))
            job.pinned = []

    def _block_bytes(self) -> int:
        runner = self.core.runner
        k = runner.kv_caches[0][0]
        return len(runner.kv_caches) * 2 * math.prod(runner.kv_block_shape) * k.element_size()

    def _empty(self) -> torch.Tensor:
        runner = self.core.runner
        return torch.empty((len(runner.kv_caches), 2, 0, *runner.kv_block_shape),
                           dtype=runner.kv_caches[0][0].dtype)
