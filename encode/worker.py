"""The encode worker: images and videos in, vision embeddings out to the prefilling worker.

    EncodeRequest(items + pixels, dest) -> queued; each step runs the tower once over every
    queued item (one varlen batch), sends each embedding to its request's destination
    through the connector (EmbeddingTransfer, keyed by mm hash), and tells the router
    (EncodeDone). A repeated image is served from this worker's encoder cache.

``python -m triptych.encode.worker`` (started by the supervisor).
"""
from __future__ import annotations

import logging
import os
import time
from dataclasses import dataclass
from typing import Any

import msgspec
import zmq
from triptych.config import EngineConfig
from triptych.connector import ConnectorError
from triptych.engine.histogram import Histogram
from triptych.engine.request import MMItem
from triptych.mmcache.consumer import WorkerPixels
from triptych.parallel.loader import load_for_role
from triptych.worker import wire
from triptych.worker.data_endpoint import data_endpoint
from triptych.worker.loop import Handler, WorkerSpec, main

logger = logging.getLogger("triptych.encode")


@dataclass
class _Job:
    request_id: str
    items: list[MMItem]
    dest: str


class EncodeWorker(Handler):
    """Runs the vision tower (one process, or rank 0 of a group) for the prefilling pools."""

    def __init__(self, spec: WorkerSpec) -> None:
        config = EngineConfig(**spec.config)
        # tensor_parallel_size > 1: rank 0 of a group that runs the tower together
        self.loaded = load_for_role(config, "encode", pool=spec.pool)
        self.shape = self.loaded.shape
        self.runner = self.loaded.encoder
        self.connector = data_endpoint(config, spec)
        self.pixels = WorkerPixels.from_config(spec.config, spec.shm_ring)
        self._jobs: list[_Job] = []
        self.bytes_sent = 0
        self.histogram = Histogram()  # seconds to encode and send one request's items

    def hello(self, spec: WorkerSpec) -> wire.Hello:
        return wire.Hello(spec.worker_id, spec.pool, os.getpid(), 0, 0, self.connector.address,
                          self.runner.cache.capacity_bytes,
                          weight_parts=self.loaded.weight_parts,
                          weight_bytes=dict(self.loaded.weight_bytes or {}),
                          rank_weight_bytes=self.loaded.group_weight_bytes(),
                          gpu_memory_share=self.loaded.gpu_memory_share)

    def handle(self, msg: Any, frames: list[bytes]) -> list[msgspec.Struct]:
        if isinstance(msg, wire.AbortRequest):
            gone = set(msg.request_ids)
            self._jobs = [j for j in self._jobs if j.request_id not in gone]
            return []
        if not isinstance(msg, wire.EncodeRequest):
            return [wire.RequestError(getattr(msg, "request_id", ""), "not an encode message")]
        items = self.pixels.items_of(msg, frames)
        if isinstance(items, wire.RequestError):
            return [items]
        try:
            merge = self.shape.spatial_merge_size
            for it in items:
                t, h, w = it.grid_thw
                if min(t, h, w) < 1 or h % merge or w % merge or \
                        it.length != t * h * w // merge ** 2:
                    raise ValueError(f"{it.modality} {it.mm_hash[:12]}: bad grid {it.grid_thw}")
                if it.pixel_values is None and it.mm_hash not in self.runner.cache:
                    raise ValueError(f"{it.modality} {it.mm_hash[:12]} has no pixels")
                if it.pixel_values is not None and it.pixel_values.shape[0] != t * h * w:
                    raise ValueError(f"{it.modality}: {it.pixel_values.shape[0]} patches for "
                                     f"grid {it.grid_thw}")
        except (ValueError, TypeError) as e:
            return [wire.RequestError(msg.request_id, str(e))]
        self._jobs.append(_Job(msg.request_id, items, msg.dest_address))
        return []

    def has_work(self) -> bool:
        return bool(self._jobs)

    def step(self) -> list[msgspec.Struct]:
        jobs, self._jobs = self._jobs, []
        t0 = time.perf_counter()
        out: list[msgspec.Struct] = []
        try:  # one tower call over every queued item (varlen attention keeps them apart)
            embs = self.runner.get_embeddings([it for j in jobs for it in j.items])
        except (ValueError, RuntimeError):
            logger.exception("encoding a batch of %d requests failed; one at a time", len(jobs))
            embs = {}
            for j in jobs:
                try:
                    embs.update(self.runner.get_embeddings(j.items))
                except (ValueError, RuntimeError) as e:
                    out.append(wire.RequestError(j.request_id, f"encoding failed: {e}"))
        failed = {m.request_id for m in out}
        for j in jobs:
            if j.request_id in failed:
                continue
            try:
                for it in j.items:
                    self.bytes_sent += self.connector.send(
                        j.dest, wire.EmbeddingTransfer(j.request_id, it.mm_hash),
                        [embs[it.mm_hash].contiguous()])
            except ConnectorError as e:
                logger.error("sending embeddings of %s failed: %s", j.request_id, e)
                out.append(wire.RequestError(j.request_id, "sending embeddings failed",
                                             retryable=True))
                continue
            out.append(wire.EncodeDone(j.request_id, [it.mm_hash for it in j.items]))
        self.histogram.observe(time.perf_counter() - t0)
        return out

    def data_socket(self) -> zmq.Socket | None:
        return self.connector.poll_socket()

    def on_data(self) -> list[msgspec.Struct]:
        while True:  # nothing is sent to an encode worker's endpoint: drain and drop
            try:
                if self.connector.recv(0) is None:
                    return []
            except ConnectorError:
                continue

    def stats(self) -> dict[str, float]:
        c = self.runner.cache
        s = {"num_requests_waiting": len(self._jobs), "encoder_cache_hits": c.num_hits,
             "encoder_cache_queries": c.num_queries, "encoder_cache_bytes": c.num_bytes,
             "encoder_cache_usage_bytes": c.num_bytes,
             "encoder_cache_capacity_bytes": c.capacity_bytes,
             "items_encoded_total": self.runner.num_items_encoded,
             "embedding_transfer_bytes_total": self.bytes_sent, **self.pixels.stats(),
             **self.loaded.weight_stats()}
        s.update(self.histogram.stats("embedding_transfer_seconds"))
        return s

    def close(self) -> None:
        self.pixels.close()
        self.connector.close()
        self.loaded.close()


if __name__ == "__main__":
    main(EncodeWorker)
