"""The colocated worker and the decode worker: continuous batching over paged KV, token ids
streamed to the router (both on ``worker/model_worker.py``'s base).

    ColocatedWorker   AddRequest (prompt + pixels): it encodes, prefills and decodes itself
    DecodeWorker      the decode pool: the same, plus
        AddRequest, no pixels   (E+PD) the items' embeddings come from encode workers; the
                                request waits in the EmbeddingInbox, then prefills here
        ReserveKV + KVTransfer  (P/D) blocks are reserved, a prefill worker fills them; the
                                request joins the batch with its first token (KVReceiver)

A request preempted here whose images cannot be re-encoded here (their embeddings live on
the prefill side) is handed back to the router, which runs it again from its tokens.
``python -m triptych.decode.worker`` (started by the supervisor for both pools).
"""
from __future__ import annotations

import logging
from typing import Any

import msgspec
from triptych.decode.kv_receiver import KVReceiver
from triptych.mmcache.consumer import items_from_wire
from triptych.worker import wire
from triptych.worker.loop import WorkerSpec, main
from triptych.worker.model_worker import ModelWorker

logger = logging.getLogger("triptych.decode")


class ColocatedWorker(ModelWorker):
    """Encode + prefill + decode in one worker; no data plane."""

    def __init__(self, spec: WorkerSpec) -> None:
        super().__init__(spec, data_plane=False)


class DecodeWorker(ModelWorker):
    """A decode-pool worker: prefills what it is given, takes KV a prefill worker sent."""

    def __init__(self, spec: WorkerSpec) -> None:
        super().__init__(spec, data_plane=True)
        self.receiver = KVReceiver(self.core, self.config.kv_transfer_timeout)

    def handle_other(self, msg: Any, frames: list[bytes]) -> list[msgspec.Struct]:
        if not isinstance(msg, wire.ReserveKV):
            return super().handle_other(msg, frames)
        if any(it.pixels is not None for it in msg.mm_items):
            raise ValueError("a KV reservation carries no pixels")
        got = self.receiver.reserve(msg, items_from_wire(msg.mm_items, frames))
        return [got] if got else []  # None: queued until blocks free up

    def abort(self, request_id: str) -> None:
        super().abort(request_id)
        self.receiver.cancel(request_id)

    def on_transfer(self, got: Any) -> list[msgspec.Struct]:
        h = got.header
        if not isinstance(h, wire.KVTransfer):
            return super().on_transfer(got)
        try:
            if len(got.tensors) != 1:
                raise ValueError(f"{len(got.tensors)} tensors in a KV transfer")
            self.receiver.on_transfer(h, got.tensors[0], got.seconds)
        except ValueError as e:  # does not fit its reservation: drop it, fail that one
            logger.warning("dropped a KV transfer for %s: %s", h.request_id, e)
            self.receiver.num_rejected += 1
            return self.on_bad_data(h.request_id)
        return []

    def on_bad_data(self, request_id: str | None) -> list[msgspec.Struct]:
        if request_id is not None and self.receiver.cancel(request_id):
            return [wire.RequestError(request_id, "a malformed KV transfer", retryable=True)]
        return []

    def housekeeping(self, now: float) -> list[msgspec.Struct]:
        out: list[msgspec.Struct] = [
            wire.RequestError(rid, "the KV transfer did not complete in time", retryable=True)
            for rid in self.receiver.expire(now)]
        out += super().housekeeping(now)
        out += self.receiver.retry()  # queued reservations, now that blocks may be free
        return out

    def stats(self) -> dict[str, float]:
        s = super().stats()
        s["kv_transfer_bytes_received_total"] = self.receiver.bytes_received
        s["kv_transfer_expired_total"] = self.receiver.num_expired
        s["kv_transfer_rejected_total"] = self.receiver.num_rejected
        s["kv_reservations_pending"] = self.receiver.num_pending
        s["requests_handed_back_total"] = self.num_handed_back
        s.update(self.receiver.histogram.stats("kv_transfer_seconds"))
        return s


def make_worker(spec: WorkerSpec) -> ModelWorker:
    """The handler for ``spec.pool`` (colocated | decode)."""
    return ColocatedWorker(spec) if spec.pool == "colocated" else DecodeWorker(spec)


if __name__ == "__main__":
    main(make_worker)
