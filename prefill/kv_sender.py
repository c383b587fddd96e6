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

Under load the decode side's lease (kv_transfer_timeout) must not run out while the request
waits here: every request not heard of for a quarter of the lease gets an empty chunk
(``keepalive``), which renews it; a prefill worker that dies stops renewing, so a leaked
reservation still ends. A decode peer that did not take a message in the connector's send
timeout is taken for gone for DEAD_PEER_S: the transfers to it fail at once instead of each
waiting out its own timeout (a kill -9 of a decode worker costs the loop one timeout, not
one per request bound to it).
"""
from __future__ import annotations

import logging
import math
import time
from dataclasses import dataclass

import torch
from triptych.connector import Connector, ConnectorError, SendTimeout
from triptych.worker import wire
from triptych.engine.engine_core import EngineCore
from triptych.engine.outputs import EngineCoreOutput

logger = logging.getLogger("triptych.prefill")
MAX_KV_MESSAGE_BYTES = 256 << 20  # one KV message at most (the connector's cap is 1 GiB)
DEAD_PEER_S = 10.0  # a decode peer that timed out is skipped this long


@dataclass
class _Outgoing:
    dest: wire.KVDest
    next_block: int  # first block not sent yet
    last_sent: float  # monotonic time of its last message (or of its arrival): keepalives


class KVSender:
    def __init__(self, core: EngineCore, connector: Connector, lease_s: float = 30.0) -> None:
        """``lease_s``: the decode side's lease (kv_transfer_timeout) this sender renews."""
        self.core, self.connector = core, connector
        self.keepalive_s = lease_s / 4
        self._out: dict[str, _Outgoing] = {}
        self._dead_peers: dict[str, float] = {}  # address -> monotonic time it may be retried
        self.keepalives = 0
        self.bytes_sent = 0
        self.seconds = 0.0
        self.transfers = 0  # requests whose KV was handed over in full
        self.sliced = 0  # messages whose KV went rank to rank (tensor-parallel groups)

    @property
    def num_outgoing(self) -> int:
        """Requests whose KV is still to send (0 once none is in flight)."""
        return len(self._out)

    def add(self, request_id: str, dest: wire.KVDest) -> None:
        self._out[request_id] = _Outgoing(dest, dest.num_cached_blocks, time.monotonic())

    def cancel(self, request_id: str) -> None:
        self._out.pop(request_id, None)
        if request_id in self.core.kv.handed_off:
            self.core.kv.release_blocks(request_id)

    def keepalive(self, now: float) -> list[str]:
        """Renew the lease of every request not sent anything for a while (an empty chunk).
        Returns request ids whose transfer failed."""
        failed = []
        for rid, o in list(self._out.items()):
            if now - o.last_sent < self.keepalive_s:
                continue
            try:
                self._message(rid, o, [], o.next_block, final=False)
                self.keepalives += 1
            except (ConnectorError, ValueError) as e:
                logger.error("KV lease renewal of %s at %s failed: %s", rid, o.dest.worker, e)
                self.cancel(rid)
                failed.append(rid)
        return failed

    def after_step(self, outs: list[EngineCoreOutput]) -> list[str]:
        """Send what this step completed. Returns request ids whose transfer failed."""
        failed = []
        handed = {o.request_id: o for o in outs if o.finish_reason == "handoff"}
        for rid, o in list(self._out.items()):
            try:
                if rid in handed:
                    self._finish(rid, o, handed[rid].new_token_ids[-1])
                else:
                    req = self.core.scheduler.requests.get(rid)
                    if req is None:  # ended without a hand-off (EOS first, abort, error)
                        del self._out[rid]
                        continue
                    full = min(req.num_computed_tokens // self.core.config.block_size,
                               o.dest.num_blocks)
                    self._send(rid, o, self.core.kv.block_ids(rid), full, final=False)
            except (ConnectorError, ValueError) as e:
                logger.error("KV transfer of %s to %s failed: %s", rid, o.dest.worker, e)
                self.cancel(rid)
                failed.append(rid)
        return failed

    def _finish(self, rid: str, o: _Outgoing, first_token: int) -> None:
        blocks = [b.block_id for b in self.core.kv.handed_off.get(rid, [])]
        if len(blocks) < o.dest.num_blocks:
            raise ValueError(f"{len(blocks)} blocks computed, {o.dest.num_blocks} expected")
        self._send(rid, o, blocks, o.dest.num_blocks, final=True, first_token=first_token)
        del self._out[rid]
        self.core.kv.release_blocks(rid)
        self.transfers += 1

    def _send(self, rid: str, o: _Outgoing, block_ids: list[int], upto: int, final: bool,
              first_token: int = -1) -> None:
        """Blocks [next_block, upto) in messages of at most MAX_KV_MESSAGE_BYTES."""
        if upto <= o.next_block and not final:
            return
        per = max(1, MAX_KV_MESSAGE_BYTES // self._block_bytes())
        start = o.next_block
        while True:
            end = min(upto, start + per)
            last = end >= upto
            self._message(rid, o, block_ids[start:end], start, final and last, first_token)
            start = o.next_block = end
            if last:
                return

    def _block_bytes(self) -> int:
        runner = self.core.runner
        k = runner.kv_caches[0][0]
        return len(runner.kv_caches) * 2 * math.prod(runner.kv_block_shape) * k.element_size()

    def _message(self, rid: str, o: _Outgoing, run: list[int], first_block: int, final: bool,
                 first_token: int = -1) -> None:
        """One KV message: ``run`` (block ids, maybe none) from ``first_block`` on."""
        address = o.dest.address
        if self._dead_peers.get(address, 0.0) > time.monotonic():
            raise ConnectorError(f"{o.dest.worker} did not take KV lately (taken for gone)")
        t0 = time.perf_counter()
        runner = self.core.runner
        group = self.core.group
        # Groups of the same size: every rank sends its own heads to its counterpart
        # (parallel/kv.py); rank 0's go with the header. Else all heads, gathered here.
        sliced = group is not None and len(o.dest.rank_addresses) == group.size
        if sliced:
            if run and not runner.send_slices(run, o.dest.rank_addresses[1:], rid,
                                              first_block):
                raise ConnectorError("a tensor-parallel rank could not send its KV slice")
            shape = runner.kv_caches[0][0].shape[1:]  # rank 0's heads
            data = runner.local_blocks(run) if run else None
        else:
            shape = runner.kv_block_shape
            data = runner.read_blocks(run) if run else None
        if data is None:
            data = torch.empty((len(runner.kv_caches), 2, 0, *shape),
                               dtype=runner.kv_caches[0][0].dtype)
        header = wire.KVTransfer(rid, first_block, final, first_token, sliced)
        self.sliced += sliced
        try:
            sent = self.connector.send(address, header, [data])
        except SendTimeout:
            self._dead_peers[address] = time.monotonic() + DEAD_PEER_S
            raise
        self._dead_peers.pop(address, None)
        self.bytes_sent += sent * (group.size if sliced else 1)  # (the ranks' slices too)
        self.seconds += time.perf_counter() - t0
        o.last_sent = time.monotonic()
