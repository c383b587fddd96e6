"""EngineClient: the one async interface the server uses to reach the engine.

    submit(request_id, prompt, params) -> async iterator of RequestDelta (ValueError: refused)
    abort([ids]) · health() -> {pool: "ok" | "dead"} · stats() -> gauges and counters

One implementation today: the engine runs in its own process (P1, a child started with
``python -m triptych.engine.core_proc``, never on the server's event loop) and talks
msgspec over ZMQ ipc:// sockets in a private (0700) temp dir. A router over the encode /
prefill / decode pools will implement the same calls.
"""
from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator

import msgspec
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
        self._pull.setsockopt(zmq.MAXMSGSIZE, wire.MAX_MESSAGE_BYTES)
        self._pull.bind(self._out_addr)
        self._queues: dict[str, asyncio.Queue] = {}
        self._stats: dict[str, float] = {}
        self._ids = itertools.count()
        self._start_timeout_s = start_timeout_s
        # A plain child process: the config goes in as JSON on stdin, so nothing is pickled
        # (multiprocessing would pickle the target and its arguments).
        self._proc = subprocess.Popen(
            [sys.executable, "-m", "triptych.engine.core_proc", self._in_addr, self._out_addr],
            stdin=subprocess.PIPE)
        assert self._proc.stdin is not None
        self._proc.stdin.write(msgspec.json.encode(dataclasses.asdict(config)))
        self._proc.stdin.close()
        logger.info("engine process %d started; sockets in %s", self._proc.pid, self._dir)
        self._reader: asyncio.Task | None = None
        self._ready = asyncio.Event()
        self._closed = False

    async def start(self) -> None:
        self._reader = asyncio.create_task(self._read_loop())
        t0 = time.monotonic()
        while not self._ready.is_set():
            if not self.alive():
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
            try:
                msg = wire.decode_from_engine(frame)
            except (msgspec.DecodeError, msgspec.ValidationError):
                logger.error("dropped a malformed message from the engine process")
                continue
            if isinstance(msg, wire.EngineStats):
                self._stats = msg.values
                self._ready.set()
                continue
            q = self._queues.get(msg.request_id)
            if q is not None:
                q.put_nowait(msg)

    # -- the interface ------------------------------------------------------------------------
    def alive(self) -> bool:
        return self._proc.poll() is None

    def health(self) -> dict[str, str]:
        """Status of every pool behind this client (one colocated engine today)."""
        return {"colocated": "ok" if self.alive() else "dead"}

    def stats(self) -> dict[str, float]:
        """The engine's latest gauges and counters (pushed every 0.25 s)."""
        return self._stats

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
        try:
            frames = wire.encode(msg, [it.pixel_values for it in prompt.mm_items])
        except (OverflowError, TypeError, msgspec.EncodeError):
            self._queues.pop(request_id, None)
            raise ValueError("the request has a value out of range") from None
        await self._push.send_multipart(frames)
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
                    raise ValueError(msg.message)  # noqa: TRY004 (refused input)
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
        """Stop P1 (Shutdown message, then kill after 10 s) and remove the socket dir."""
        if self._closed:
            return
        self._closed = True
        if self.alive():
            with contextlib.suppress(asyncio.TimeoutError):
                await asyncio.wait_for(self._push.send_multipart(wire.encode(wire.Shutdown())), 2)
            try:
                await asyncio.to_thread(self._proc.wait, 10)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                await asyncio.to_thread(self._proc.wait, 5)
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
