"""The engine process (P1): ZMQ in, LLMEngine.step(), ZMQ out.

    P0 --PUSH--> [in socket]  AddRequest / AbortRequest / StatsRequest / Shutdown
    P0 <--PULL-- [out socket] RequestDelta / RequestError / EngineStats

A malformed message or a request the engine refuses becomes a RequestError for that
request (or is dropped and logged when it names none); the loop never dies of it.
"""
from __future__ import annotations

import logging
import time
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


def run_engine_loop(config: dict[str, Any], in_addr: str, out_addr: str) -> None:
    """Process entry point: build the engine, then serve until Shutdown."""
    logging.basicConfig(level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s[P1]: %(message)s")
    engine = LLMEngine(EngineConfig(**config))
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.MAXMSGSIZE, 1 << 30)
    pull.connect(in_addr)
    push = ctx.socket(zmq.PUSH)
    push.connect(out_addr)
    push.send(msgspec.msgpack.encode(wire.EngineStats(engine.stats())))  # "ready"
    last_stats = 0.0
    try:
        while True:
            # Block for input only when idle; otherwise drain what arrived and step.
            timeout = 0 if engine.has_unfinished_requests() else int(STATS_INTERVAL_S * 1000)
            while pull.poll(timeout):
                timeout = 0
                frames = pull.recv_multipart(copy=True)
                if _handle(engine, frames, push) == "shutdown":
                    return
            try:
                outs = engine.step()
            except Exception:  # a bug, not bad input: fail the running requests, keep serving
                logger.exception("engine step failed; aborting the requests in flight")
                outs = []
                for rid in list(engine.outputs.parents):
                    push.send(msgspec.msgpack.encode(wire.RequestError(rid, "internal error")))
                    engine.abort_request([rid])
            for out in outs:
                push.send(msgspec.msgpack.encode(_delta(out)))
            now = time.monotonic()
            if now - last_stats >= STATS_INTERVAL_S:
                last_stats = now
                push.send(msgspec.msgpack.encode(wire.EngineStats(engine.stats())))
    finally:
        pull.close(0)
        push.close(0)
        ctx.term()


def _handle(engine: LLMEngine, frames: list[bytes], push: zmq.Socket) -> str | None:
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
        push.send(msgspec.msgpack.encode(wire.EngineStats(engine.stats())))
    elif isinstance(msg, wire.AddRequest):
        try:
            _add(engine, msg, frames)
        except (ValueError, TypeError) as e:
            push.send(msgspec.msgpack.encode(wire.RequestError(msg.request_id, str(e))))
    return None
