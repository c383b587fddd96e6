"""KVSender: a prefill worker's outgoing KV, block by block, as the prompt's chunks finish.

    request blocks:  [0 .. cached) [cached .......... full) [full .. n)
                      decode side   sent after each step     sent at hand-off with the
                      holds these   once their KV is final   first token (final=True)

A long prompt's blocks leave while later chunks are still being computed; blocks the
decode worker's prefix cache already holds (``num_cached_blocks`` from its reservation) are
never sent. One message carries a run of blocks of every layer:
``[num_layers, 2 (k, v), n, block_size, num_kv_heads, head_dim]``.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch
from triptych.connector import Connector, ConnectorError
from triptych.worker import wire
from triptych.engine.engine_core import EngineCore
from triptych.engine.outputs import EngineCoreOutput

logger = logging.getLogger("triptych.prefill")


@dataclass
class _Outgoing:
    dest: wire.KVDest
    next_block: int  # first block not sent yet


class KVSender:
    def __init__(self, core: EngineCore, connector: Connector) -> None:
        self.core, self.connector = core, connector
        self._out: dict[str, _Outgoing] = {}
        self.bytes_sent = 0
        self.seconds = 0.0
        self.transfers = 0  # requests whose KV was handed over in full
        self.sliced = 0  # messages whose KV went rank to rank (tensor-parallel groups)

    def add(self, request_id: str, dest: wire.KVDest) -> None:
        self._out[request_id] = _Outgoing(dest, dest.num_cached_blocks)

    def cancel(self, request_id: str) -> None:
        self._out.pop(request_id, None)
        if request_id in self.core.kv.handed_off:
            self.core.kv.release_blocks(request_id)

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
        if upto <= o.next_block and not final:
            return
        t0 = time.perf_counter()
        run = block_ids[o.next_block:upto]
        runner = self.core.runner
        group = self.core.group
        # Groups of the same size: every rank sends its own heads to its counterpart
        # (parallel/kv.py); rank 0's go with the header. Else all heads, gathered here.
        sliced = group is not None and len(o.dest.rank_addresses) == group.size
        if sliced:
            if run and not runner.send_slices(run, o.dest.rank_addresses[1:], rid,
                                              o.next_block):
                raise ConnectorError("a tensor-parallel rank could not send its KV slice")
            shape = runner.kv_caches[0][0].shape[1:]  # rank 0's heads
            data = runner.local_blocks(run) if run else None
        else:
            shape = runner.kv_block_shape
            data = runner.read_blocks(run) if run else None
        if data is None:
            data = torch.empty((len(runner.kv_caches), 2, 0, *shape),
                               dtype=runner.kv_caches[0][0].dtype)
        header = wire.KVTransfer(rid, o.next_block, final, first_token, sliced)
        self.sliced += sliced
        sent = self.connector.send(o.dest.address, header, [data])
        self.bytes_sent += sent * (group.size if sliced else 1)  # (the ranks' slices too)
        self.seconds += time.perf_counter() - t0
        o.next_block = upto
