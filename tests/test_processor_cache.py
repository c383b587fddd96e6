"""The key-replicated LRU processor cache: P0's ProcessorCacheMirror and P1's
ProcessorCacheStore must agree under repeats, evictions, aborts, concurrency, and recover
when they are forced apart (vLLM #31404 killed an engine exactly there)."""
from __future__ import annotations

import hashlib
import importlib.util
import os
import queue
import random
import subprocess
import sys
import threading
from collections import deque
from dataclasses import dataclass, field

import msgspec
import pytest
import torch
import zmq

from triptych.mmcache import (DATA, DATA_UNCACHED, REF, ProcessorCacheMirror, ProcessorCacheMiss,
                              ProcessorCacheStore, StoreItem)

WORKER = os.path.join(os.path.dirname(__file__), "proc_cache_worker.py")
_spec = importlib.util.spec_from_file_location("proc_cache_worker", WORKER)
w = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(w)  # its message Structs; the same file runs as the P1 process

torch.set_num_threads(1)
KEYS = [hashlib.blake2b(str(i).encode(), digest_size=32).hexdigest() for i in range(16)]


def numel(key: str) -> int:
    return 1 + int(key[:4], 16) % 24  # 1..24 float32 elements, fixed per key


def pixels(key: str) -> torch.Tensor:
    return torch.arange(numel(key), dtype=torch.float32) + int(key[4:8], 16)


def nbytes(key: str) -> int:
    return numel(key) * 4


def store_items(keys: list[str], ops: list[str]) -> list[StoreItem]:
    return [StoreItem(k, op, None if op == REF else pixels(k),
                      (torch.float32, (numel(k),)) if op == REF else None)
            for k, op in zip(keys, ops)]


# -- exact behaviour ---------------------------------------------------------------------------
def test_plan_and_apply_step_by_step():
    m, s = ProcessorCacheMirror(100), ProcessorCacheStore(100)

    def send(items: list[tuple[str, int]]) -> tuple[list[str], list[str]]:
        plan = m.plan(items)
        data = [StoreItem(k, op, None if op == REF else torch.zeros(n // 4))
                for (k, n), op in zip(items, plan.ops)]
        out = s.apply(plan.evicted, data)
        assert [t.numel() * 4 for t in out] == [n for _, n in items]
        assert set(m.keys()) == s.keys() and m.num_bytes == s.num_bytes
        m.check_integrity()
        s.check_integrity()
        return plan.ops, plan.evicted

    assert send([("a", 40), ("b", 40)]) == ([DATA, DATA], [])
    assert send([("a", 40)]) == ([REF], [])  # a is now the most recently used
    assert send([("c", 40)]) == ([DATA], ["b"])  # b was the least recently used
    # d does not fit unless c or a goes, but this message uses both: d travels uncached.
    assert send([("c", 40), ("d", 40), ("a", 40)]) == ([REF, DATA_UNCACHED, REF], [])
    assert send([("big", 104)]) == ([DATA_UNCACHED], [])  # larger than the cache
    assert send([("e", 24), ("e", 24)]) == ([DATA, REF], ["c"])  # a second use is a ref
    assert m.keys() == ["a", "e"]
    m.forget_all()
    assert m.keys() == [] and m.num_bytes == 0


def test_plan_without_pixels_changes_nothing_until_they_are_loaded():
    m = ProcessorCacheMirror(100)
    m.plan([("a", 40)])
    items = [("b", 40), ("a", 40), ("c", 40)]
    p = m.plan(items, have_data=[False, False, True])  # a is held: a ref needs no pixels
    assert (p.need_data, p.seq, p.ops, p.evicted) == ([0], 0, [], [])
    assert m.keys() == ["a"] and m.num_bytes == 40  # untouched
    p = m.plan(items, have_data=[True, False, True])
    assert (p.seq, p.ops, p.need_data) == (2, [DATA, REF, DATA_UNCACHED], [])


def test_store_refuses_malformed_messages_before_changing_anything():
    s = ProcessorCacheStore(1000)
    s.apply([], [StoreItem("a", DATA, torch.zeros(4))])
    for bad in ([StoreItem("b", REF, torch.zeros(1))], [StoreItem("b", DATA)],
                [StoreItem("b", "steal")]):
        with pytest.raises(ValueError):
            s.apply(["a"], bad)
        assert "a" in s  # the eviction in the malformed message was not applied


def test_store_miss_is_an_exception_after_the_rest_is_applied():
    s = ProcessorCacheStore(1000)
    s.apply([], [StoreItem("a", DATA, torch.zeros(4))])
    with pytest.raises(ProcessorCacheMiss) as e:
        s.apply(["a"], [StoreItem("x", REF), StoreItem("b", DATA, torch.ones(2)),
                        StoreItem("y", REF)])
    assert e.value.keys == ["x", "y"] and s.keys() == {"b"} and s.num_misses == 2
    # A ref whose tensor is not what P0 describes is a miss too, and the entry goes.
    with pytest.raises(ProcessorCacheMiss):
        s.apply([], [StoreItem("b", REF, spec=(torch.float32, (3,)))])
    assert "b" not in s


def test_store_keeps_its_byte_cap_even_if_p0_is_wrong():
    s = ProcessorCacheStore(16)
    out = s.apply([], [StoreItem("a", DATA, torch.zeros(8))])  # 32 bytes: P0 misjudged
    assert len(out) == 1 and "a" not in s and s.num_refused == 1 and s.num_bytes == 0
    with pytest.raises(ProcessorCacheMiss):
        s.apply([], [StoreItem("a", REF)])


# -- property: random request sequences ------------------------------------------------------
@dataclass
class Msg:
    rid: int
    seq: int
    keys: list[str]
    ops: list[str]
    evicted: list[str]


@dataclass
class Sim:
    """P0 with one mirror per worker, ordered channels, and P1 stores; checks every reply."""

    capacity: int
    num_workers: int
    mirrors: list[ProcessorCacheMirror] = field(default_factory=list)
    stores: list[ProcessorCacheStore] = field(default_factory=list)
    channels: list[deque[Msg]] = field(default_factory=list)
    cleared: list[bool] = field(default_factory=list)  # P1 cleared behind P0's back
    aborted: set[int] = field(default_factory=set)
    requests: dict[int, tuple[int, list[str]]] = field(default_factory=dict)
    answered: set[int] = field(default_factory=set)
    num_misses: int = 0
    next_rid: int = 0
    rng: random.Random = field(default_factory=lambda: random.Random(0))

    def __post_init__(self) -> None:
        for _ in range(self.num_workers):
            self.mirrors.append(ProcessorCacheMirror(self.capacity))
            self.stores.append(ProcessorCacheStore(self.capacity))
            self.channels.append(deque())
            self.cleared.append(False)

    def submit(self, worker: int, keys: list[str]) -> int:
        rid, self.next_rid = self.next_rid, self.next_rid + 1
        self.requests[rid] = (worker, keys)
        self._send(rid)
        return rid

    def _send(self, rid: int) -> None:
        worker, keys = self.requests[rid]
        items, mirror = [(k, nbytes(k)) for k in keys], self.mirrors[worker]
        # Some items come without pixels (P0 index hits): they must be refs, or be loaded.
        have = [self.rng.random() < 0.6 for _ in keys]
        plan = mirror.plan(items, have)
        if plan.need_data:
            assert plan.seq == 0 and all(not have[i] and not mirror.holds(keys[i])
                                         for i in plan.need_data)
            have = [True] * len(keys)
            plan = mirror.plan(items, have)
        assert all(h or op == REF for h, op in zip(have, plan.ops)), "data without pixels"
        self.channels[worker].append(Msg(rid, plan.seq, keys, plan.ops, plan.evicted))

    def abort(self, rid: int) -> None:
        self.aborted.add(rid)  # planned messages are still delivered and applied

    def deliver(self, worker: int) -> None:
        if not self.channels[worker]:
            return
        msg = self.channels[worker].popleft()
        try:
            out = self.stores[worker].apply(msg.evicted, store_items(msg.keys, msg.ops))
        except ProcessorCacheMiss as e:
            assert self.cleared[worker], "a miss while P0 and P1 agree"
            self.num_misses += 1
            self.mirrors[worker].forget(e.keys, msg.seq)
            if msg.rid not in self.aborted:
                self._send(msg.rid)  # P0 re-sends the request, now with the pixels
            return
        for k, t in zip(msg.keys, out):
            assert torch.equal(t, pixels(k)), "a ref resolved to other pixels"
        self.answered.add(msg.rid)

    def clear_behind_p0(self, worker: int) -> None:
        self.stores[worker].clear()
        self.cleared[worker] = True

    def restart(self, worker: int) -> None:
        """A restarted worker: empty store, lost in-flight messages, P0 forgets all."""
        lost = [m.rid for m in self.channels[worker]]
        self.channels[worker].clear()
        self.stores[worker] = ProcessorCacheStore(self.capacity)
        self.mirrors[worker].forget_all()
        self.cleared[worker] = False
        for rid in lost:
            if rid not in self.aborted:
                self._send(rid)

    def check(self) -> None:
        for m, s, cleared, channel in zip(self.mirrors, self.stores, self.cleared,
                                          self.channels):
            m.check_integrity()
            s.check_integrity()
            if channel:
                continue  # P0 is ahead by the messages in flight
            assert s.keys() <= set(m.keys())  # P1 never holds what P0 cannot evict
            if not cleared:
                assert s.keys() == set(m.keys()) and s.num_bytes == m.num_bytes

    def drain(self) -> None:
        while any(self.channels):
            for worker in range(self.num_workers):
                self.deliver(worker)
        self.check()
        unanswered = set(self.requests) - self.answered - self.aborted
        assert not unanswered, f"requests never answered: {unanswered}"


def run_sequence(rng: random.Random, steps: int) -> Sim:
    keys = rng.sample(KEYS, rng.randint(2, len(KEYS)))
    sim = Sim(capacity=rng.choice([0, 16, 60, 120, 400]), num_workers=rng.randint(1, 3),
              rng=random.Random(rng.random()))
    for _ in range(steps):
        r, worker = rng.random(), rng.randrange(sim.num_workers)
        if r < 0.5:
            items = [rng.choice(keys) for _ in range(rng.randint(1, 4))]
            sim.submit(worker, items)
        elif r < 0.85:
            sim.deliver(worker)
        elif r < 0.95:
            if sim.requests:
                sim.abort(rng.randrange(sim.next_rid))
        elif r < 0.98:
            sim.clear_behind_p0(worker)
        else:
            sim.restart(worker)
        sim.check()
    sim.drain()
    return sim


def test_mirror_and_store_agree_over_thousands_of_random_sequences():
    rng = random.Random(1234)
    misses = 0
    for _ in range(2000):
        misses += run_sequence(rng, rng.randint(5, 40)).num_misses
    assert misses > 0  # the forced disagreements were exercised (and recovered)


def test_property_with_hypothesis():
    import hypothesis  # the [test] extra
    from hypothesis import strategies as st

    @hypothesis.settings(max_examples=300, deadline=None, derandomize=True)
    @hypothesis.given(st.integers(0, 2**32 - 1), st.integers(1, 60))
    def prop(seed: int, steps: int) -> None:
        run_sequence(random.Random(seed), steps)

    prop()


# -- a real P1 process, concurrent P0 submitters -------------------------------------------------
class P0:
    """Mirror + ordered channel to one real worker process; replies routed by request id."""

    def __init__(self, tmp_path, capacity: int) -> None:
        self.ctx = zmq.Context()
        self.push, self.pull = self.ctx.socket(zmq.PUSH), self.ctx.socket(zmq.PULL)
        out_addr, in_addr = f"ipc://{tmp_path}/to-p1", f"ipc://{tmp_path}/from-p1"
        self.push.bind(out_addr)
        self.pull.bind(in_addr)
        self.proc = subprocess.Popen([sys.executable, WORKER, out_addr, in_addr, str(capacity)])
        self.mirror = ProcessorCacheMirror(capacity)
        self.send_lock = threading.Lock()
        self.replies: dict[int, queue.Queue] = {}
        self.dumps: queue.Queue = queue.Queue()
        self.enc, self.dec = msgspec.msgpack.Encoder(), msgspec.msgpack.Decoder(w.FromWorker)
        self.rid_lock = threading.Lock()
        self.next_rid = 0
        self.stopping = False
        self.receiver = threading.Thread(target=self._receive, daemon=True)
        self.receiver.start()

    def _receive(self) -> None:
        while not self.stopping:
            if not self.pull.poll(100):
                continue
            msg = self.dec.decode(self.pull.recv())
            if isinstance(msg, w.Keys):
                self.dumps.put(msg)
            else:
                self.replies[msg.rid].put(msg)

    def send(self, msg: msgspec.Struct, frames: list[bytes] = ()) -> None:
        with self.send_lock:
            self.push.send_multipart([self.enc.encode(msg), *frames])

    def request(self, keys: list[str], abort: bool = False) -> msgspec.Struct:
        """Send one request (re-sending it after a miss) and return its final reply."""
        with self.rid_lock:
            rid, self.next_rid = self.next_rid, self.next_rid + 1
        self.replies[rid] = queue.Queue()
        for _ in range(10):  # each miss makes P0 forget keys: a retry always progresses
            # NOTE: plan and send under one lock: the worker applies plans in plan order.
            with self.send_lock:
                plan = self.mirror.plan([(k, nbytes(k)) for k in keys])
                items = [w.WireItem(k, op, numel(k)) for k, op in zip(keys, plan.ops)]
                frames = [pixels(k).numpy().tobytes() for k, op in zip(keys, plan.ops)
                          if op != REF]
                self.push.send_multipart([self.enc.encode(w.Add(rid, plan.evicted, items)),
                                          *frames])
                if abort:
                    self.push.send(self.enc.encode(w.Abort(rid)))
            reply = self.replies[rid].get(timeout=60)
            if isinstance(reply, w.Miss):
                self.mirror.forget(reply.keys, plan.seq)
                continue
            return reply
        raise AssertionError(f"request {rid} kept missing")

    def dump(self) -> w.Keys:
        self.send(w.Dump())
        return self.dumps.get(timeout=60)

    def close(self) -> None:
        try:
            self.send(w.Stop())
            self.dumps.get(timeout=60)
            self.proc.wait(timeout=60)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
                self.proc.wait(timeout=10)
            self.stopping = True
            self.receiver.join(timeout=10)
            self.push.close(0)
            self.pull.close(0)
            self.ctx.term()


def expected(keys: list[str]) -> list[str]:
    return [w.digest(pixels(k)) for k in keys]


@pytest.mark.parametrize("clear_midway", [False, True])
def test_concurrent_submitters_and_a_real_worker_agree(tmp_path, clear_midway):
    p0 = P0(tmp_path, capacity=300)
    errors: list[BaseException] = []
    counts = {"result": 0, "aborted": 0}

    def submitter(seed: int) -> None:
        rng = random.Random(seed)
        try:
            for i in range(60):
                keys = [rng.choice(KEYS[:10]) for _ in range(rng.randint(1, 3))]
                abort = rng.random() < 0.2
                reply = p0.request(keys, abort=abort)
                if isinstance(reply, w.Result):
                    assert reply.digests == expected(keys)
                    counts["result"] += 1
                else:
                    assert abort and isinstance(reply, w.Aborted)
                    counts["aborted"] += 1
                if clear_midway and seed == 0 and i == 30:
                    p0.send(w.Clear())  # the worker forgets everything; P0 is not told
        except BaseException as e:  # noqa: BLE001 - reported below
            errors.append(e)

    try:
        threads = [threading.Thread(target=submitter, args=(s,)) for s in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=240)
        assert not any(t.is_alive() for t in threads), "a submitter hung"
        assert not errors, errors
        assert counts["result"] + counts["aborted"] == 240 and counts["result"] > 100
        state = p0.dump()
        assert set(state.keys) <= set(p0.mirror.keys())
        if not clear_midway:
            assert set(state.keys) == set(p0.mirror.keys())
            assert state.num_bytes == p0.mirror.num_bytes and state.num_misses == 0
        assert p0.proc.poll() is None  # misses never kill the worker
    finally:
        p0.close()


def test_forced_disagreement_is_recovered(tmp_path):
    p0 = P0(tmp_path, capacity=1000)
    try:
        keys = KEYS[:3]
        assert p0.request(keys).digests == expected(keys)
        assert p0.request(keys).digests == expected(keys)  # all refs now
        assert p0.dump().num_misses == 0
        p0.send(w.Clear())  # P1 loses its cache behind P0's back
        assert p0.mirror.keys() == keys
        assert p0.request(keys[::-1]).digests == expected(keys[::-1])  # miss -> re-sent
        state = p0.dump()
        assert state.num_misses == 3 and sorted(state.keys) == sorted(keys)
        assert p0.request(keys).digests == expected(keys)
        assert p0.dump().num_misses == 3  # back in agreement: refs resolve again
    finally:
        p0.close()
