"""The decode worker: continuous batching over paged KV, token ids streamed to the router.

It takes requests three ways:
    AddRequest              a whole request (prompt + pixels): it prefills and encodes it
                            itself. This is the colocated engine, and the PD worker.
    AddRequest, no pixels   (E+PD) the items' embeddings come from encode workers; the
                            request waits in the EmbeddingInbox, then prefills here.
    ReserveKV + KVTransfer  (P/D) blocks are reserved, a prefill worker fills them; the
                            request joins the batch with its first token (KVReceiver).

A request preempted here whose images cannot be re-encoded here (their embeddings live on
the prefill side) is handed back to the router, which runs it again from its tokens.
``python -m triptych.decode.worker`` (started by the supervisor).
"""
from __future__ import annotations

import logging
import os
from typing import Any

import msgspec
import zmq
from triptych.config import EngineConfig
from triptych.worker import wire
from triptych.engine.engine_core import EngineCore
from triptych.engine.request import MMItem, Request, RequestStatus
from triptych.worker.loop import Handler, WorkerSpec, main
from triptych.mmcache.consumer import WorkerPixels, items_from_wire

logger = logging.getLogger("triptych.decode")


class DecodeWorker(Handler):
    def __init__(self, spec: WorkerSpec) -> None:
        config = EngineConfig(**spec.config)
        self.pooled = spec.pool == "decode"  # pools exchange data through a connector
        from triptych.worker.data_endpoint import endpoint_kind, key_name
        self.core = EngineCore(config, eos_token_id=spec.eos_token_id,
                               data_kind=endpoint_kind(config, spec) if self.pooled else "",
                               key_name=key_name(spec))
        self.pixels = WorkerPixels.from_config(spec.config, spec.shm_ring)
        self.connector = self.receiver = self.inbox = None
        if self.pooled:
            from triptych.decode.kv_receiver import KVReceiver
            from triptych.worker.data_endpoint import data_endpoint
            from triptych.worker.embedding_inbox import EmbeddingInbox

            self.connector = data_endpoint(config, spec)
            self.receiver = KVReceiver(self.core, config.kv_transfer_timeout)
            self.inbox = EmbeddingInbox(self.core.encoder.cache, self.core.hidden_size,
                                        self.core.dtype, config.kv_transfer_timeout)
        self._pending: list[msgspec.Struct] = []  # replies produced by callbacks
        self.num_handed_back = 0

    def hello(self, spec: WorkerSpec) -> wire.Hello:
        return wire.Hello(spec.worker_id, spec.pool, os.getpid(), self.core.max_model_len,
                          self.core.num_blocks,
                          self.connector.address if self.connector else "",
                          self.core.encoder.cache.capacity_bytes, self._rank_addresses())

    def _rank_addresses(self) -> list[str]:
        g = self.core.group
        if self.connector is None or g is None or not g.rank_addresses:
            return []
        return [self.connector.address, *g.rank_addresses]

    # -- control ---------------------------------------------------------------------------
    def handle(self, msg: Any, frames: list[bytes]) -> list[msgspec.Struct]:
        if isinstance(msg, wire.AbortRequest):
            for rid in msg.request_ids:
                self.core.abort([rid])
                if self.pooled:
                    self.receiver.cancel(rid)
                    self.inbox.cancel(rid)
            return []
        try:
            if isinstance(msg, wire.AddRequest):
                items = self.pixels.items_of(msg, frames)
                return [items] if isinstance(items, wire.RequestError) else self._add(msg, items)
            if isinstance(msg, wire.ReserveKV) and self.pooled:
                if any(it.pixels is not None for it in msg.mm_items):
                    raise ValueError("a KV reservation carries no pixels")
                got = self.receiver.reserve(msg, items_from_wire(msg.mm_items, frames))
                return [got] if got else []  # None: queued until blocks free up
            raise ValueError(f"this worker does not take {type(msg).__name__} messages")
        except (ValueError, TypeError) as e:  # refused input: the message names it
            return [wire.RequestError(msg.request_id, str(e))]

    def _add(self, msg: wire.AddRequest, items: list[MMItem]) -> list[msgspec.Struct]:
        def admit() -> None:
            try:
                self.core.add_request(msg.request_id, msg.prompt_token_ids, msg.params, items,
                                      output_token_ids=msg.output_token_ids)
            except ValueError as e:
                self._pending.append(wire.RequestError(msg.request_id, str(e)))

        needs_remote = [it for it in items if it.pixel_values is None]
        if not needs_remote or not self.pooled:
            for it in needs_remote:
                if it.mm_hash not in self.core.encoder.cache:
                    raise ValueError(f"{it.modality} {it.mm_hash[:12]} has no pixels and no "
                                     "cached embedding on this worker")
            self.core.add_request(msg.request_id, msg.prompt_token_ids, msg.params, items,
                                  output_token_ids=msg.output_token_ids)
            return []
        self.core.check_request(msg.prompt_token_ids, msg.params, items, msg.output_token_ids)
        missing = self.inbox.wait(msg.request_id, items, admit)
        out, self._pending = self._pending, []
        unexpected = sorted(set(missing) - set(msg.encoding))
        if unexpected:
            out.append(wire.NeedEmbeddings(msg.request_id, unexpected))
        return out

    # -- data (pools) ------------------------------------------------------------------------
    def data_socket(self) -> zmq.Socket | None:
        return self.connector.poll_socket() if self.connector else None

    def on_data(self) -> list[msgspec.Struct]:
        from triptych.connector import BadMessage

        out: list[msgspec.Struct] = []
        for _ in range(256):
            try:
                got = self.connector.recv(0)
            except BadMessage as e:
                logger.warning("dropped a bad data message: %s", e)
                rid = getattr(e.header, "request_id", None)
                if rid is not None and self.receiver.cancel(rid):
                    out.append(wire.RequestError(rid, "a malformed KV transfer",
                                                 retryable=True))
                continue
            if got is None:
                break
            h = got.header
            if isinstance(h, wire.KVTransfer):
                try:
                    if len(got.tensors) != 1:
                        raise ValueError(f"{len(got.tensors)} tensors in a KV transfer")
                    self.receiver.on_transfer(h, got.tensors[0], got.seconds)
                except ValueError as e:  # does not fit its reservation: drop, fail that one
                    logger.warning("dropped a KV transfer for %s: %s", h.request_id, e)
                    self.receiver.num_rejected += 1
                    if self.receiver.cancel(h.request_id):
                        out.append(wire.RequestError(h.request_id, "a malformed KV transfer",
                                                     retryable=True))
            elif isinstance(h, wire.EmbeddingTransfer) and len(got.tensors) == 1:
                self.inbox.deliver(h.mm_hash, got.tensors[0])
            else:
                logger.warning("dropped an unexpected %s", type(h).__name__)
        out += self._pending
        self._pending = []
        return out

    def housekeeping(self, now: float) -> list[msgspec.Struct]:
        if not self.pooled:
            return []
        out: list[msgspec.Struct] = [
            wire.RequestError(rid, "the KV transfer did not complete in time", retryable=True)
            for rid in self.receiver.expire(now)]
        out += [wire.RequestError(rid, "image embeddings did not arrive in time",
                                  retryable=True) for rid in self.inbox.expire(now)]
        out += self.receiver.retry()  # queued reservations, now that blocks may be free
        return out

    # -- the loop -----------------------------------------------------------------------------
    def has_work(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[msgspec.Struct]:
        out: list[msgspec.Struct] = []
        outs = self.core.step()
        if outs:
            out.append(wire.StepOutputs(outs))
        for rid in self.core.last_preempted:
            req = self.core.scheduler.requests.get(rid)
            if req is not None and not self._recomputable(req):
                self.core.scheduler.finish(req, RequestStatus.FINISHED_ABORTED)
                out.append(wire.HandBack(rid, list(req.output_token_ids)))
                self.num_handed_back += 1
        return out

    def _recomputable(self, req: Request) -> bool:
        """Whether a preempted request can be prefilled again here (its images' pixels or
        embeddings at hand)."""
        return all(it.pixel_values is not None or it.embedding is not None
                   or it.mm_hash in self.core.encoder.cache for it in req.mm_items)

    def stats(self) -> dict[str, float]:
        s = self.core.stats() | self.pixels.stats()
        if self.pooled:
            s["kv_transfer_bytes_received_total"] = self.receiver.bytes_received
            s["kv_transfer_expired_total"] = self.receiver.num_expired
            s["kv_transfer_rejected_total"] = self.receiver.num_rejected
            s["kv_reservations_pending"] = self.receiver.num_pending
            s["requests_handed_back_total"] = self.num_handed_back
            s.update(self.receiver.histogram.stats("kv_transfer_seconds"))
        return s

    def close(self) -> None:
        self.pixels.close()
        if self.connector is not None:
            self.connector.close()
        self.core.close()


if __name__ == "__main__":
    main(DecodeWorker)
