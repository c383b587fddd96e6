"""ModelWorker: the base of every worker that runs an EngineCore (colocated, decode, prefill).

    AddRequest     -> pixels from the processor cache -> admit: into the core at once, or,
                      when an item comes without pixels, once its embedding has arrived
                      from the encode pool (EmbeddingInbox; NeedEmbeddings when the router
                      thought this worker still held one)
    data socket    -> EmbeddingTransfer into the inbox; anything else to ``on_transfer``
    step           -> core.step(): StepOutputs; a preempted request whose images cannot be
                      encoded again here is handed back (HandBack) for the router to re-run

The pools add what is theirs in small subclasses: ``decode/worker.py`` (the colocated
engine, and the decode pool's KV reservations), ``prefill/worker.py`` (the KV hand-off).
A worker with a data plane (``data_plane=True``, every pool worker) has a connector
endpoint and an inbox; the colocated one has neither.
"""
from __future__ import annotations

import logging
import os
from typing import Any

import msgspec
import zmq
from triptych.config import EngineConfig
from triptych.engine.outputs import EngineCoreOutput
from triptych.engine.request import MMItem, Request
from triptych.mmcache.consumer import WorkerPixels
from triptych.parallel.loader import load_engine_core
from triptych.worker import wire
from triptych.worker.data_endpoint import data_endpoint, endpoint_kind, key_name
from triptych.worker.embedding_inbox import EmbeddingInbox
from triptych.worker.grammar_wait import GrammarWait
from triptych.worker.loop import Handler, WorkerSpec

logger = logging.getLogger("triptych.worker")
MAX_DATA_PER_POLL = 256  # data messages taken per wake-up (then the loop steps again)


class ModelWorker(Handler):
    """Engine core, pixels, data endpoint and embedding inbox of one worker."""

    def __init__(self, spec: WorkerSpec, data_plane: bool) -> None:
        self.config = config = EngineConfig(**spec.config)
        self.core = load_engine_core(
            config, spec.eos_token_id, data_kind=endpoint_kind(config, spec) if data_plane else "",
            key_name=key_name(spec), pool=spec.pool)
        self.connector = self.inbox = None
        pixels = None
        try:
            self.pixels = pixels = WorkerPixels.from_config(spec.config, spec.shm_ring)
            if data_plane:
                self.connector = data_endpoint(config, spec)
                self.inbox = EmbeddingInbox(self.core.encoder.cache, self.core.payload_width,
                                            self.core.dtype, config.kv_transfer_timeout)
        except BaseException:
            if pixels is not None:
                pixels.close()
            self.core.close()  # (its tensor-parallel ranks stop with it)
            raise
        self._pending: list[msgspec.Struct] = []  # replies of callbacks (admit) to send
        self.last_outputs: list[EngineCoreOutput] = []  # the last step's outputs
        self.num_handed_back = 0
        self.grammar_wait = GrammarWait()  # structured-output requests while they compile

    def hello(self, spec: WorkerSpec) -> wire.Hello:
        return wire.Hello(spec.worker_id, spec.pool, os.getpid(), self.core.max_model_len,
                          self.core.num_blocks,
                          self.connector.address if self.connector else "",
                          self.core.encoder.cache.capacity_bytes, self._rank_addresses(),
                          weight_parts=self.core.loaded.weight_parts,
                          weight_bytes=dict(self.core.loaded.weight_bytes or {}),
                          rank_weight_bytes=self.core.loaded.group_weight_bytes())

    def _rank_addresses(self) -> list[str]:
        """A group's data addresses, rank by rank (rank to rank KV between groups)."""
        g = self.core.group
        if self.connector is None or g is None or not g.rank_addresses:
            return []
        return [self.connector.address, *g.rank_addresses]

    # -- control ---------------------------------------------------------------------------
    def handle(self, msg: Any, frames: list[bytes]) -> list[msgspec.Struct]:
        if isinstance(msg, wire.AbortRequest):
            for rid in msg.request_ids:
                self.abort(rid)
            return []
        try:
            if isinstance(msg, wire.AddRequest):
                items = self.pixels.items_of(msg, frames)
                if isinstance(items, wire.RequestError):
                    return [items]
                spec = msg.params.structured_outputs
                if spec is not None and self.grammar_wait.park(
                        msg.request_id, self.core.grammars.submit(spec), msg, items):
                    return []  # admitted by housekeeping once its grammar compiled
                return self._add(msg, items)
            return self.handle_other(msg, frames)
        except (ValueError, TypeError) as e:  # refused input: the message names it
            return [wire.RequestError(msg.request_id, str(e))]

    def handle_other(self, msg: Any, frames: list[bytes]) -> list[msgspec.Struct]:
        """A message other than AddRequest / AbortRequest (ValueError: refused)."""
        raise ValueError(f"this worker does not take {type(msg).__name__} messages")

    def abort(self, request_id: str) -> None:
        """Forget a request wherever it is (waiting for embeddings, in the core)."""
        if self.inbox is not None:
            self.inbox.cancel(request_id)
        self.grammar_wait.cancel(request_id)
        self.core.abort([request_id])

    def admit(self, msg: wire.AddRequest, items: list[MMItem]) -> None:
        """Put a request whose items all have pixels or embeddings into the core."""
        self.core.add_request(msg.request_id, msg.prompt_token_ids, msg.params, items,
                              output_token_ids=msg.output_token_ids)

    def _add(self, msg: wire.AddRequest, items: list[MMItem]) -> list[msgspec.Struct]:
        if self.inbox is None:  # no encode pool feeds this worker: pixels or cached only
            for it in items:
                if it.pixel_values is None and it.mm_hash not in self.core.encoder.cache:
                    raise ValueError(f"{it.modality} {it.mm_hash[:12]} has no pixels and no "
                                     "cached embedding on this worker")
            self.admit(msg, items)
            return []
        # NOTE: checked before it waits, so a bad request is refused now, not after its
        # embeddings arrive; admit's own errors (an id in use meanwhile) come back later.
        self.core.check_request(msg.prompt_token_ids, msg.params, items, msg.output_token_ids)

        def admit() -> None:
            try:
                self.admit(msg, items)
            except ValueError as e:
                self._pending.append(wire.RequestError(msg.request_id, str(e)))

        missing = self.inbox.wait(msg.request_id, items, admit)
        out, self._pending = self._pending, []
        unexpected = sorted(set(missing) - set(msg.encoding))
        if unexpected:  # the router thought we held these; the cache let them go
            out.append(wire.NeedEmbeddings(msg.request_id, unexpected))
        return out

    # -- data (pools) ------------------------------------------------------------------------
    def data_socket(self) -> zmq.Socket | None:
        return self.connector.poll_socket() if self.connector else None

    def on_data(self) -> list[msgspec.Struct]:
        from triptych.connector import BadMessage

        out: list[msgspec.Struct] = []
        for _ in range(MAX_DATA_PER_POLL):
            try:
                got = self.connector.recv(0)
            except BadMessage as e:
                logger.warning("dropped a bad data message: %s", e)
                out += self.on_bad_data(getattr(e.header, "request_id", None))
                continue
            if got is None:
                break
            if isinstance(got.header, wire.EmbeddingTransfer) and len(got.tensors) == 1:
                self.inbox.deliver(got.header.mm_hash, got.tensors[0])
            else:
                out += self.on_transfer(got)
        out += self._pending
        self._pending = []
        return out

    def on_transfer(self, got: Any) -> list[msgspec.Struct]:
        """A data message other than an embedding (a decode worker's KV)."""
        logger.warning("dropped an unexpected %s", type(got.header).__name__)
        return []

    def on_bad_data(self, request_id: str | None) -> list[msgspec.Struct]:
        """A data message that did not parse, naming ``request_id`` (or None)."""
        return []

    def housekeeping(self, now: float) -> list[msgspec.Struct]:
        out: list[msgspec.Struct] = []
        for msg, items, err in self.grammar_wait.ready():
            try:
                if err is not None:
                    raise ValueError(err)
                out += self._add(msg, items)
            except (ValueError, TypeError) as e:
                out.append(wire.RequestError(msg.request_id, str(e)))
        if self.inbox is None:
            return out
        return out + [wire.RequestError(rid, "image embeddings did not arrive in time",
                                        retryable=True) for rid in self.inbox.expire(now)]

    # -- the loop -----------------------------------------------------------------------------
    def has_work(self) -> bool:
        return self.core.has_unfinished_requests()

    def step(self) -> list[msgspec.Struct]:
        res = self.core.step()
        self.last_outputs = res.outputs
        out: list[msgspec.Struct] = [wire.StepOutputs(res.outputs)] if res.outputs else []
        for req in res.preempted:
            if not self._recomputable(req):
                self.core.abort([req.request_id])
                out.append(wire.HandBack(req.request_id, list(req.output_token_ids)))
                self.num_handed_back += 1
        return out

    def _recomputable(self, req: Request) -> bool:
        """Whether a preempted request can be prefilled again here (its images' pixels or
        embeddings at hand)."""
        return all(it.pixel_values is not None or it.embedding is not None
                   or it.mm_hash in self.core.encoder.cache for it in req.mm_items)

    def stats(self) -> dict[str, float]:
        return self.core.stats() | self.pixels.stats() | self.core.loaded.weight_stats() | \
            self.tracked()

    def tracked(self) -> dict[str, float]:
        """Entries of every per-request structure (``tracked_<name>``): all back to 0 once
        no request is in flight, or one of them leaks (tests/test_soak_bounds.py); the
        persistent batch keeps its last step's rows (<= max_num_seqs) until the next step."""
        core = self.core
        out = {"tracked_requests": len(core.scheduler.requests),
               "tracked_kv_requests": len(core.kv.req_blocks) + len(core.kv.handed_off),
               "tracked_batch_rows": len(core.runner.batch.index),
               "tracked_seeded_generators": len(core.runner.sampler._generators),
               "tracked_grammar_waits": len(self.grammar_wait),
               "tracked_encoder_pins": len(core.encoder.cache._refs)}
        if self.inbox is not None:
            out["tracked_embedding_waits"] = len(self.inbox)
        return out

    def close(self) -> None:
        self.pixels.close()
        if self.connector is not None:
            self.connector.close()
        self.core.close()
