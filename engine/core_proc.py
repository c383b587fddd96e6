"""The engine process (P1): ZMQ in, LLMEngine.step(), ZMQ out.

    P0 --PUSH--> [in socket]  AddRequest / AbortRequest / StatsRequest / Shutdown
    P0 <--PULL-- [out socket] RequestDelta / RequestError / EngineStats

A malformed message or a request the engine refuses becomes a RequestError for that
request (or is dropped and logged when it names none); the loop never dies of it. If P0
goes away without a Shutdown (killed), P1 notices its parent changed and exits.
"""
from __future__ import annotations

import logging
import os
import shutil
import signal
import sys
import time
from collections.abc import Callable
from typing import Any

import msgspec
import zmq
from triptych.config import EngineConfig
from triptych.engine import wire
from triptych.engine.llm_engine import LLMEngine
from triptych.engine.outputs import RequestOutput
from triptych.engine.request import MMItem

logger = logging.getLogger("triptych.core")
STATS_INTERVAL_S = 0.25


def _delta(out: RequestOutput) -> wire.RequestDelta:
    comps = []
    for c in out.outputs:
        if not c.token_ids_delta and c.finish_reason is None and not c.text_delta:
            continue
        lps = None
        if c.logprobs is not None and c.token_ids_delta:
            lps = [{t: lp.logprob for t, lp in d.items()}
                   for d in c.logprobs[-len(c.token_ids_delta):]]
        comps.append(wire.CompletionDelta(c.index, c.text_delta, c.token_ids_delta,
                                          c.finish_reason, c.stop_reason, lps))
    return wire.RequestDelta(out.request_id, comps, out.finished, len(out.prompt_token_ids),
                             out.num_cached_tokens)


def _add(engine: LLMEngine, msg: wire.AddRequest, frames: list[bytes]) -> None:
    if len(frames) != len(msg.mm_items) + 1:
        raise ValueError("tensor frames do not match the items")
    items = []
    for it, frame in zip(msg.mm_items, frames[1:]):
        if len(it.grid_thw) != 3:
            raise ValueError("bad patch grid")
        pv = wire.tensor_from_frame(it.pixels, frame)
        items.append(MMItem(it.modality, it.mm_hash, it.offset, it.length,
                            tuple(it.grid_thw), pv, it.second_per_grid_t))
    msg.params.verify()
    engine.add_request(msg.request_id, msg.prompt_token_ids, msg.params, items, msg.prompt)


class _Orphaned(Exception):
    """P0 went away without a Shutdown."""


class _Sender:
    """PUSH to P0. A send that cannot go out for a second checks that P0 still exists
    (ZMQ would otherwise block forever once its queue to a dead peer is full)."""

    def __init__(self, sock: zmq.Socket, parent: int) -> None:
        self.sock, self.parent = sock, parent
        sock.setsockopt(zmq.SNDTIMEO, 1000)

    def __call__(self, msg: msgspec.Struct) -> None:
        data = msgspec.msgpack.encode(msg)
        while True:
            try:
                return self.sock.send(data)
            except zmq.Again:
                if os.getppid() != self.parent:
                    raise _Orphaned from None


def run_engine_loop(config: dict[str, Any], in_addr: str, out_addr: str) -> None:
    """Process entry point: build the engine, then serve until Shutdown."""
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s[P1]: %(message)s")
    # NOTE: Ctrl-C reaches the whole process group; P0 owns shutdown and sends Shutdown.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    parent = os.getppid()
    engine = LLMEngine(EngineConfig(**config))
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.MAXMSGSIZE, wire.MAX_MESSAGE_BYTES)
    pull.connect(in_addr)
    push = ctx.socket(zmq.PUSH)
    push.connect(out_addr)
    send = _Sender(push, parent)
    try:
        send(wire.EngineStats(engine.stats()))  # "ready"
        _serve(engine, pull, send, parent)
    except _Orphaned:
        # P0 was killed: nobody will read our outputs or remove the private socket dir.
        logger.warning("the API server process is gone; the engine process exits")
        shutil.rmtree(os.path.dirname(in_addr.removeprefix("ipc://")), ignore_errors=True)
    finally:
        pull.close(0)
        push.close(0)
        ctx.term()


def _serve(engine: LLMEngine, pull: zmq.Socket, send: _Sender, parent: int) -> None:
    last_stats = 0.0
    while True:
        if os.getppid() != parent:
            raise _Orphaned
        # Block for input only when idle; otherwise drain what arrived and step.
        timeout = 0 if engine.has_unfinished_requests() else int(STATS_INTERVAL_S * 1000)
        while pull.poll(timeout):
            timeout = 0
            if _handle(engine, pull.recv_multipart(copy=True), send) == "shutdown":
                return
        try:
            outs = engine.step()
        except Exception:  # a bug, not bad input: fail the running requests, keep serving
            logger.exception("engine step failed; aborting the requests in flight")
            outs = []
            for rid in list(engine.outputs.parents):
                send(wire.RequestError(rid, "internal error"))
                engine.abort_request([rid])
        for out in outs:
            send(_delta(out))
        now = time.monotonic()
        if now - last_stats >= STATS_INTERVAL_S:
            last_stats = now
            send(wire.EngineStats(engine.stats()))


def _handle(engine: LLMEngine, frames: list[bytes], send: Callable[[msgspec.Struct], None]
            ) -> str | None:
    """One message from P0. Nothing a message holds can end the loop but Shutdown."""
    try:
        msg = wire.decode_to_engine(frames)
    except (msgspec.DecodeError, msgspec.ValidationError, IndexError):
        logger.warning("dropped a malformed message (%d frames)", len(frames))
        return None
    if isinstance(msg, wire.Shutdown):
        return "shutdown"
    if isinstance(msg, wire.AbortRequest):
        engine.abort_request(msg.request_ids)
    elif isinstance(msg, wire.StatsRequest):
        send(wire.EngineStats(engine.stats()))
    elif isinstance(msg, wire.AddRequest):
        try:
            _add(engine, msg, frames)
        except (ValueError, TypeError) as e:  # refused input: the message names the problem
            send(wire.RequestError(msg.request_id, str(e)))
        except Exception:  # anything else is our bug: log it, refuse the request, keep going
            logger.exception("adding request %r failed", msg.request_id)
            send(wire.RequestError(msg.request_id, "internal error"))
    return None


def main() -> None:
    """``python -m triptych.engine.core_proc IN_ADDR OUT_ADDR`` with the EngineConfig as
    JSON on stdin (how EngineClient starts P1)."""
    in_addr, out_addr = sys.argv[1:3]
    config = msgspec.json.decode(sys.stdin.buffer.read(), type=dict[str, Any])
    run_engine_loop(config, in_addr, out_addr)


if __name__ == "__main__":
    main()
