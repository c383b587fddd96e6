"""KVReceiver: a decode worker's incoming KV, into blocks it reserved, under a lease.

    ReserveKV (router)  -> validate the request, look up the prefix cache, allocate the
                           remaining blocks, reply KVReserved; no room: queue (same lease)
    KVTransfer (prefill) -> checked against the reservation (known request, block range
                           inside it, exact cache layout and dtype) and copied in
    final chunk          -> every block present: the request joins the running batch with
                           its first token, as if it had been prefilled here

Every reservation has a lease of ``timeout_s``, renewed by every chunk that arrives (the
prefill worker sends an empty one while the request waits in its queue: see
prefill/kv_sender.py): a transfer whose sender goes silent that long frees its blocks and
fails that request alone (the router runs it again), so a leaked reservation can never hold
KV space for long (CVE-2026-94625 in another engine), while a long or queued prefill under
load keeps its blocks.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass

import torch
from triptych.worker import wire
from triptych.engine.kv.block_hash import extend_block_hashes
from triptych.engine.kv.block_pool import KVBlock
from triptych.engine.engine_core import EngineCore
from triptych.engine.histogram import Histogram
from triptych.engine.request import MMItem, Request

logger = logging.getLogger("triptych.decode")
SLICE_TIMEOUT_S = 5.0  # the ranks' slices left before the header did: they are near


@dataclass
class _Reservation:
    request: Request
    num_blocks: int
    num_cached_blocks: int
    blocks: list[KVBlock]  # every block of the request, hits first
    received: int  # blocks present: [0, received) (cached ones count)
    deadline: float


class KVReceiver:
    def __init__(self, core: EngineCore, timeout_s: float) -> None:
        self.core, self.timeout_s = core, timeout_s
        self.bs = core.config.block_size
        self._held: dict[str, _Reservation] = {}
        self._queued: deque[tuple[Request, float]] = deque()  # waiting for free blocks
        self.bytes_received = 0
        self.num_expired = 0
        self.num_rejected = 0  # transfers that failed validation
        self.histogram = Histogram()  # seconds per KV message (sender's send -> copied here)

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._held or any(r.request_id == request_id
                                               for r, _ in self._queued)

    @property
    def num_pending(self) -> int:
        return len(self._held) + len(self._queued)

    # -- reservations ----------------------------------------------------------------------
    def reserve(self, msg: wire.ReserveKV, items: list[MMItem]) -> wire.KVReserved | None:
        """Validate and hold blocks; None when queued for room. Raises ValueError."""
        if msg.request_id in self or msg.request_id in self.core.scheduler.requests:
            raise ValueError(f"request id {msg.request_id!r} is already in use")
        positions, delta = self.core.check_request(msg.prompt_token_ids, msg.params, items,
                                                   msg.output_token_ids)
        req = Request(msg.request_id, list(msg.prompt_token_ids), msg.params, items,
                      eos_token_id=self.core.eos_token_id, mrope_positions=positions,
                      mrope_delta=delta)
        req.output_token_ids = list(msg.output_token_ids)
        self._queued.append((req, time.monotonic() + self.timeout_s))
        out = self.retry()
        return out[0] if out and out[0].request_id == msg.request_id else None

    def retry(self) -> list[wire.KVReserved]:
        """Reserve for queued requests, in order, while blocks last."""
        done = []
        while self._queued:
            req, deadline = self._queued[0]
            held = self._allocate(req)
            if held is None:
                break
            self._queued.popleft()
            held.deadline = deadline
            self._held[req.request_id] = held
            done.append(wire.KVReserved(req.request_id, held.num_blocks, held.num_cached_blocks))
        return done

    def _allocate(self, req: Request) -> _Reservation | None:
        kv = self.core.kv
        n_tokens = req.num_tokens  # KV of every known token comes from the prefill side
        n_blocks = -(-n_tokens // self.bs)
        hits: list[KVBlock] = []
        if kv.enable_prefix_caching:
            extend_block_hashes(req, self.bs)
            for h in req.block_hashes[:n_tokens // self.bs]:
                blk = kv.pool.lookup(h)
                if blk is None:
                    break
                hits.append(blk)
        revived = sum(1 for b in hits if b.ref_cnt == 0)
        if n_blocks - len(hits) + revived > kv.pool.num_free_blocks:
            return None
        kv.pool.touch(hits)
        blocks = hits + kv.pool.allocate(n_blocks - len(hits))
        return _Reservation(req, n_blocks, len(hits), blocks, len(hits), 0.0)

    def cancel(self, request_id: str) -> bool:
        """Drop a reservation (abort, or the router gave up on it); frees its blocks."""
        held = self._held.pop(request_id, None)
        if held is not None:
            self.core.kv.pool.free(list(reversed(held.blocks)))
            return True
        before = len(self._queued)
        self._queued = deque((r, d) for r, d in self._queued if r.request_id != request_id)
        return len(self._queued) != before

    def expire(self, now: float) -> list[str]:
        """Reservations whose lease ran out: freed; their requests fail (the router retries)."""
        late = [rid for rid, h in self._held.items() if now > h.deadline]
        late += [r.request_id for r, d in self._queued if now > d]
        for rid in late:
            self.cancel(rid)
            self.num_expired += 1
            logger.warning("KV transfer for %s did not complete in %.0f s; blocks freed",
                           rid, self.timeout_s)
        return late

    # -- transfers -------------------------------------------------------------------------
    def on_transfer(self, hdr: wire.KVTransfer, data: torch.Tensor, seconds: float = 0.0
                    ) -> Request | None:
        """Copy a chunk in; returns the request once its last chunk is in (it is then in
        the scheduler's running set). Raises ValueError for a transfer that does not fit
        its reservation (the caller drops it and fails that request)."""
        held = self._held.get(hdr.request_id)
        if held is None:
            raise ValueError(f"KV for unknown request {hdr.request_id!r}")
        runner, group = self.core.runner, self.core.group
        if hdr.sliced and group is None:
            raise ValueError("a rank-to-rank KV transfer for a worker without ranks")
        k_cache = runner.kv_caches[0][0]
        n = data.shape[2] if data.dim() == 6 else -1
        heads = k_cache.shape[1:] if hdr.sliced else runner.kv_block_shape
        want = (len(runner.kv_caches), 2, n, *heads)
        if data.dim() != 6 or tuple(data.shape) != want or data.dtype != k_cache.dtype:
            raise ValueError(f"KV chunk {tuple(data.shape)} {data.dtype} does not match the "
                             f"cache layout {want} {k_cache.dtype}")
        if hdr.first_block != held.received or hdr.first_block + n > held.num_blocks:
            raise ValueError(f"KV chunk covers blocks [{hdr.first_block}, {hdr.first_block + n})"
                             f"; expected from {held.received} within {held.num_blocks}")
        held.deadline = time.monotonic() + self.timeout_s  # the sender is alive: renewed
        if n:
            ids = [b.block_id for b in held.blocks[hdr.first_block:hdr.first_block + n]]
            if hdr.sliced:  # the other ranks take their slices (sent rank to rank) first
                if not runner.recv_slices(ids, hdr.request_id, hdr.first_block,
                                          SLICE_TIMEOUT_S):
                    raise ValueError("a tensor-parallel rank's KV slice did not arrive")
                runner.write_local(ids, data)
            else:
                runner.write_blocks(ids, data)
            held.received += n
            self.bytes_received += data.numel() * data.element_size() * (
                group.size if hdr.sliced else 1)
        if n or hdr.final:  # (a lease renewal moves nothing: not a transfer to time)
            self.histogram.observe(seconds)
        if not hdr.final:
            return None
        if held.received != held.num_blocks:
            raise ValueError(f"final KV chunk with {held.received} of {held.num_blocks} blocks")
        if not 0 <= hdr.first_token < self.core.shape.vocab_size:
            raise ValueError("first token out of the vocabulary")
        del self._held[hdr.request_id]
        req = held.request
        req.num_computed_tokens = req.num_tokens
        req.output_token_ids.append(hdr.first_token)
        req.num_resumed_tokens = req.num_output_tokens  # all emitted by the prefill side
        req.prompt_logprobs_sent = True  # (so were the prompt's logprobs)
        self.core.scheduler.add_prefilled_request(req, [b.block_id for b in held.blocks])
        return req
