"""The prefill worker: a request's prompt KV and first token, then the KV to a decode worker.

    AddRequest(kv_dest)  -> [wait for embeddings from the encode pool] -> prefill (chunked,
                            prefix-cached) -> first token to the router (StepOutputs,
                            finish_reason "handoff") -> the KV blocks to the decode worker
                            (KVSender: full blocks as chunks finish, the rest at hand-off)

Without an encode pool the worker runs the vision tower itself on the pixels it receives.
``python -m triptych.prefill.worker`` (started by the supervisor).
"""
from __future__ import annotations

import logging
import os
from typing import Any

import msgspec
import zmq
from triptych.config import EngineConfig
from triptych.connector import BadMessage
from triptych.worker import wire
from triptych.worker.data_endpoint import data_endpoint
from triptych.engine.engine_core import EngineCore
from triptych.worker.loop import Handler, WorkerSpec, main
from triptych.mmcache.consumer import WorkerPixels
from triptych.worker.embedding_inbox import EmbeddingInbox
from triptych.prefill.kv_sender import KVSender

logger = logging.getLogger("triptych.prefill")


class PrefillWorker(Handler):
    def __init__(self, spec: WorkerSpec) -> None:
        config = EngineConfig(**spec.config)
        from triptych.worker.data_endpoint import endpoint_kind, key_name
        self.core = EngineCore(config, eos_token_id=spec.eos_token_id,
                               data_kind=endpoint_kind(config, spec), key_name=key_name(spec))
        self.pixels = WorkerPixels.from_config(spec.config, spec.shm_ring)
        self.connector = data_endpoint(config, spec)
        self.sender = KVSender(self.core, self.connector)
        self.inbox = EmbeddingInbox(self.core.encoder.cache, self.core.hidden_size,
                                    self.core.dtype, config.kv_transfer_timeout)
        self._errors: list[msgspec.Struct] = []

    def hello(self, spec: WorkerSpec) -> wire.Hello:
        return wire.Hello(spec.worker_id, spec.pool, os.getpid(), self.core.max_model_len,
                          self.core.num_blocks, self.connector.address,
                          self.core.encoder.cache.capacity_bytes)

    def handle(self, msg: Any, frames: list[bytes]) -> list[msgspec.Struct]:
        if isinstance(msg, wire.AbortRequest):
            for rid in msg.request_ids:
                self.inbox.cancel(rid)
                self.core.abort([rid])
                self.sender.cancel(rid)
            return []
        if not isinstance(msg, wire.AddRequest):
            return [wire.RequestError(getattr(msg, "request_id", ""), "not a prefill message")]
        items = self.pixels.items_of(msg, frames)
        if isinstance(items, wire.RequestError):
            return [items]
        try:
            if msg.kv_dest is None:
                raise ValueError("a prefill worker needs a KV destination")
            self.core.check_request(msg.prompt_token_ids, msg.params, items, msg.output_token_ids)
        except (ValueError, TypeError) as e:
            return [wire.RequestError(msg.request_id, str(e))]

        def admit() -> None:
            try:
                self.core.add_request(msg.request_id, msg.prompt_token_ids, msg.params, items,
                                      hand_off_after_prefill=True,
                                      output_token_ids=msg.output_token_ids)
                self.sender.add(msg.request_id, msg.kv_dest)
            except ValueError as e:
                self._errors.append(wire.RequestError(msg.request_id, str(e)))

        missing = self.inbox.wait(msg.request_id, items, admit)
        unexpected = sorted(set(missing) - set(msg.encoding))
        out = self._errors
        self._errors = []
        if unexpected:  # the router thought we held these; the cache let them go
            out.append(wire.NeedEmbeddings(msg.request_id, unexpected))
        return out

    def has_work(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[msgspec.Struct]:
        self._outs = self.core.step()
        return [wire.StepOutputs(self._outs)] if self._outs else []

    def after_step(self) -> list[msgspec.Struct]:
        # NOTE: the first token reached the router (step's reply) before its KV leaves, so
        # the router knows the request moved before the decode worker's tokens arrive.
        failed = self.sender.after_step(self._outs)
        return [wire.RequestError(rid, "KV transfer to the decode worker failed",
                                  retryable=True) for rid in failed]

    def data_socket(self) -> zmq.Socket | None:
        return self.connector.poll_socket()

    def on_data(self) -> list[msgspec.Struct]:
        for _ in range(256):
            try:
                got = self.connector.recv(0)
            except BadMessage as e:
                logger.warning("dropped a bad data message: %s", e)
                continue
            if got is None:
                break
            if isinstance(got.header, wire.EmbeddingTransfer) and len(got.tensors) == 1:
                self.inbox.deliver(got.header.mm_hash, got.tensors[0])
            else:
                logger.warning("dropped an unexpected %s", type(got.header).__name__)
        out = self._errors
        self._errors = []
        return out

    def housekeeping(self, now: float) -> list[msgspec.Struct]:
        return [wire.RequestError(rid, "image embeddings did not arrive in time",
                                  retryable=True) for rid in self.inbox.expire(now)]

    def stats(self) -> dict[str, float]:
        s = self.core.stats() | self.pixels.stats()
        s["kv_transfer_bytes_total"] = self.sender.bytes_sent
        s["kv_transfers_total"] = self.sender.transfers
        s["kv_transfer_rank_to_rank_total"] = self.sender.sliced
        s["requests_waiting_for_embeddings"] = len(self.inbox)
        return s

    def close(self) -> None:
        self.pixels.close()
        self.connector.close()
        self.core.close()


if __name__ == "__main__":
    main(PrefillWorker)
