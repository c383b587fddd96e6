"""A stand-in P1 for tests/test_processor_cache.py: a real process that owns a
ProcessorCacheStore and applies P0's messages from a ZMQ socket, as a worker will.

Messages are msgspec Structs (msgpack) plus one raw frame per item that carries data:
nothing is pickled. It drains what has arrived, then handles it in order, like one
engine step: an add whose abort arrived in the same batch still has its cache part
applied (the rule of mmcache/lru.py), then is dropped.

Usage: python proc_cache_worker.py <pull address> <push address> <capacity bytes>
"""
from __future__ import annotations

import hashlib
import sys

import msgspec
import torch
import zmq

from triptych.mmcache import REF, ProcessorCacheMiss, ProcessorCacheStore, StoreItem

torch.set_num_threads(1)


class WireItem(msgspec.Struct):
    key: str  # mm hash
    op: str  # ref | data | data-uncached
    numel: int  # float32 elements; data items have a frame


class Add(msgspec.Struct, tag="add"):
    rid: int
    evicted: list[str]
    items: list[WireItem]


class Abort(msgspec.Struct, tag="abort"):
    rid: int


class Clear(msgspec.Struct, tag="clear"):  # forget everything behind P0's back
    pass


class Dump(msgspec.Struct, tag="dump"):
    pass


class Stop(msgspec.Struct, tag="stop"):
    pass


class Result(msgspec.Struct, tag="result"):
    rid: int
    digests: list[str]  # blake2b of each item's float32 bytes, in order


class Miss(msgspec.Struct, tag="miss"):
    rid: int
    keys: list[str]


class Aborted(msgspec.Struct, tag="aborted"):
    rid: int


class Keys(msgspec.Struct, tag="keys"):
    keys: list[str]
    num_bytes: int
    num_misses: int


ToWorker = Add | Abort | Clear | Dump | Stop
FromWorker = Result | Miss | Aborted | Keys


def digest(t: torch.Tensor) -> str:
    return hashlib.blake2b(t.contiguous().view(torch.uint8).numpy().tobytes(),
                           digest_size=16).hexdigest()


def handle(store: ProcessorCacheStore, msg: Add, frames: list[bytes], aborted: set[int]
           ) -> msgspec.Struct:
    items, f = [], 0
    for it in msg.items:
        data = None
        if it.op != REF:
            raw = frames[f]
            f += 1
            if len(raw) != it.numel * 4:
                raise ValueError("frame size does not match its item")
            data = torch.frombuffer(bytearray(raw), dtype=torch.float32)
        spec = (torch.float32, (it.numel,)) if it.op == REF else None
        items.append(StoreItem(it.key, it.op, data, spec))
    try:
        out = store.apply(msg.evicted, items)  # applied even when the request was aborted
    except ProcessorCacheMiss as e:
        return Aborted(msg.rid) if msg.rid in aborted else Miss(msg.rid, e.keys)
    if msg.rid in aborted:
        return Aborted(msg.rid)
    return Result(msg.rid, [digest(t) for t in out])


def main() -> None:
    pull_addr, push_addr, capacity = sys.argv[1], sys.argv[2], int(sys.argv[3])
    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    pull.connect(pull_addr)
    push.connect(push_addr)
    dec, enc = msgspec.msgpack.Decoder(ToWorker), msgspec.msgpack.Encoder()
    store = ProcessorCacheStore(capacity)
    while True:
        if not pull.poll(30_000):  # P0 is gone: never hang
            return
        batch = [pull.recv_multipart()]
        while pull.poll(0):
            batch.append(pull.recv_multipart())
        msgs = [(dec.decode(frames[0]), frames[1:]) for frames in batch]
        aborted = {m.rid for m, _ in msgs if isinstance(m, Abort)}
        for m, frames in msgs:
            if isinstance(m, Add):
                push.send(enc.encode(handle(store, m, frames, aborted)))
            elif isinstance(m, Clear):
                store.clear()
            elif isinstance(m, Dump):
                store.check_integrity()
                push.send(enc.encode(Keys(sorted(store.keys()), store.num_bytes,
                                          store.num_misses)))
            elif isinstance(m, Stop):
                push.send(enc.encode(Keys([], 0, 0)))
                pull.close(0)
                push.close(1000)
                ctx.term()
                return


if __name__ == "__main__":
    main()
