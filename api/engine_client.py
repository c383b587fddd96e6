"""EngineClient: the one async interface the server uses to reach the engine.

One implementation today: the engine runs in its own process (P1, spawned, never on the
server's event loop) and talks msgspec over ZMQ ipc:// sockets in a private temp dir. A
router over encode / prefill / decode pools will implement the same four calls.
"""
from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import multiprocessing as mp
import os
import shutil
import tempfile
import time
from typing import AsyncIterator

import zmq
import zmq.asyncio

from triptych.api.processor import ProcessedPrompt
from triptych.config import EngineConfig
from triptych.engine import wire
from triptych.engine.sampling_params import SamplingParams

logger = logging.getLogger("triptych.api")


class EngineDeadError(RuntimeError):
    pass


class EngineClient:
    def __init__(self, config: EngineConfig, start_timeout_s: float = 600.0) -> None:
        self.config = config
        self._dir = tempfile.mkdtemp(prefix="triptych-")
        self._in_addr = f"ipc://{self._dir}/in"
        self._out_addr = f"ipc://{self._dir}/out"
        self._ctx = zmq.asyncio.Context()
        self._push = self._ctx.socket(zmq.PUSH)
        self._push.bind(self._in_addr)
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.bind(self._out_addr)
        self._queues: dict[str, asyncio.Queue] = {}
        self.stats: dict[str, float] = {}
        self._ids = itertools.count()
        self._start_timeout_s = start_timeout_s
        spawn = mp.get_context("spawn")
        from triptych.engine.core_proc import run_engine_loop
        self._proc = spawn.Process(target=run_engine_loop, daemon=True, name="triptych-engine",
                                   args=(dataclasses.asdict(config), self._in_addr,
                                         self._out_addr))
        self._proc.start()
        self._reader: asyncio.Task | None = None
        self._ready = asyncio.Event()

    async def start(self) -> None:
        self._reader = asyncio.create_task(self._read_loop())
        t0 = time.monotonic()
        while not self._ready.is_set():
            if not self._proc.is_alive():
                raise EngineDeadError("the engine process exited during start-up (see its log)")
            if time.monotonic() - t0 > self._start_timeout_s:
                raise EngineDeadError("the engine process did not start in time")
            try:
                await asyncio.wait_for(self._ready.wait(), 0.5)
            except asyncio.TimeoutError:
                pass

    async def _read_loop(self) -> None:
        while True:
            frame = await self._pull.recv()
            msg = wire.decode_from_engine(frame)
            if isinstance(msg, wire.EngineStats):
                self.stats = msg.values
                self._ready.set()
                continue
            q = self._queues.get(msg.request_id)
            if q is not None:
                q.put_nowait(msg)

    # -- the interface ------------------------------------------------------------------------
    def alive(self) -> bool:
        return self._proc.is_alive()

    def new_request_id(self, prefix: str) -> str:
        return f"{prefix}-{os.getpid()}-{next(self._ids)}"

    async def submit(self, request_id: str, prompt: ProcessedPrompt, params: SamplingParams
                     ) -> AsyncIterator[wire.RequestDelta]:
        """Stream this request's deltas; raises ValueError if the engine refuses it."""
        if not self.alive():
            raise EngineDeadError("the engine process is not running")
        q: asyncio.Queue = asyncio.Queue()
        self._queues[request_id] = q
        items = [wire.WireMMItem(it.modality, it.mm_hash, it.offset, it.length,
                                 list(it.grid_thw), wire.tensor_meta(it.pixel_values),
                                 it.second_per_grid_t) for it in prompt.mm_items]
        msg = wire.AddRequest(request_id, prompt.prompt_token_ids, params, items,
                              prompt.prompt_text)
        await self._push.send_multipart(wire.encode(msg, [it.pixel_values
                                                          for it in prompt.mm_items]))
        finished = False
        try:
            while True:
                try:
                    msg = await asyncio.wait_for(q.get(), 1.0)
                except asyncio.TimeoutError:
                    if not self.alive():
                        raise EngineDeadError("the engine process died") from None
                    continue
                if isinstance(msg, wire.RequestError):
                    finished = True
                    raise ValueError(msg.message)
                yield msg
                if msg.finished:
                    finished = True
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished:  # the consumer went away (client disconnect): free it in P1
                await self.abort([request_id])

    async def abort(self, request_ids: list[str]) -> None:
        await self._push.send_multipart(wire.encode(wire.AbortRequest(request_ids)))

    async def shutdown(self) -> None:
        if self._proc.is_alive():
            await self._push.send_multipart(wire.encode(wire.Shutdown()))
            self._proc.join(10)
            if self._proc.is_alive():
                self._proc.kill()
        if self._reader:
            self._reader.cancel()
        self._push.close(0)
        self._pull.close(0)
        self._ctx.term()
        shutil.rmtree(self._dir, ignore_errors=True)

    @property
    def num_in_flight(self) -> int:
        return len(self._queues)


__all__ = ["EngineClient", "EngineDeadError"]
