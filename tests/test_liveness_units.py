"""Liveness and classification, in process (issue 15, points 2, 7, 8): the supervisor's
watch survives a failed start and says so; a tensor-parallel rank's death that lands while
a message is handled ends the worker (a migration), never a 400; two failure reports of one
attempt start one new attempt; a remote worker is refused a local worker's name or another
checkpoint."""
from __future__ import annotations

import asyncio
import errno
import os
import subprocess
import sys

import pytest
from triptych.router import supervisor as supervisor_mod
from triptych.router.handle import WorkerHandle
from triptych.router.supervisor import Supervisor
from triptych.worker import wire


# -- the supervisor survives its own errors -------------------------------------------------
def test_supervisor_survives_a_failed_start_and_says_so(monkeypatch):
    """A worker exits; its restart's fork fails with EAGAIN: logged, /health degraded, retried
    with the backoff; the next start works and the state is ok again."""
    real_popen = subprocess.Popen
    calls = {"n": 0}

    def popen(cmd, **kw):
        calls["n"] += 1
        if calls["n"] == 1:
            raise OSError(errno.EAGAIN, "Resource temporarily unavailable")
        # a stand-in worker: reads its spec and waits (killed by the test)
        code = "import sys, time; sys.stdin.read(); time.sleep(60)"
        return real_popen([sys.executable, "-c", code], stdin=subprocess.PIPE)

    monkeypatch.setattr(supervisor_mod.subprocess, "Popen", popen)
    monkeypatch.setattr(supervisor_mod, "BACKOFF_MIN_S", 0.01)
    exits: list[int] = []
    sup = Supervisor("ipc:///nonexistent", None, lambda w, code: exits.append(code))
    w = WorkerHandle("colocated", 0, {})
    w.proc = real_popen([sys.executable, "-c", "raise SystemExit(3)"])
    w.proc.wait()
    w.state = "up"
    sup.workers.append(w)

    async def run() -> None:
        task = asyncio.create_task(sup.watch())
        try:
            for _ in range(3000):  # a hang guard (tens of seconds), not a speed claim
                if sup.health()["state"] == "degraded":
                    break
                await asyncio.sleep(0.01)
            h = sup.health()
            assert h["state"] == "degraded" and h["failing_to_start"] == ["colocated-0"]
            assert "EAGAIN" in h["last_error"] or "temporarily" in h["last_error"]
            for _ in range(3000):
                if w.proc.poll() is None:  # the retry started a process
                    break
                await asyncio.sleep(0.01)
            assert not task.done(), "the watch must keep running"
        finally:
            task.cancel()

    try:
        asyncio.run(run())
        assert exits == [3]
        assert w.proc.poll() is None and w.restarts == 1 and w.spawn_error == ""
        assert sup.health()["state"] == "ok" and sup.errors_total == 1
    finally:
        if w.proc.poll() is None:
            w.proc.kill()
            w.proc.wait()


def test_supervisor_kills_a_silent_worker(monkeypatch):
    """An up worker with no heartbeat past the timeout is SIGKILLed (a stopped one too),
    then reported like any exit."""
    sup = Supervisor("ipc:///nonexistent", None, lambda w, code: None, heartbeat_timeout_s=2.0)
    w = WorkerHandle("colocated", 0, {})
    w.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        os.kill(w.proc.pid, 19)  # SIGSTOP: frozen, as in the issue
        w.state, w.last_seen = "up", 100.0
        sup.workers.append(w)
        sup._stopping = True  # no restart here (that path is tested above)
        for t in (100.5, 101.0, 101.5):
            sup.check(t)
        assert w.state == "up" and w.proc.poll() is None  # not silent long enough yet
        sup.check(105.0)  # P0's own loop was blocked 3.5 s: its heartbeats may wait unread
        assert w.state == "up"
        sup.check(105.2)
        for t in (106.0, 106.8, 107.4):  # silent 2 s past P0's resumption
            sup.check(t)
        assert w.state == "stalled"
        w.proc.wait(30)  # a hang guard
        sup.check(107.5)
        assert w.state == "dead" and w.proc.returncode == -9
    finally:
        if w.proc.poll() is None:
            w.proc.kill()
            w.proc.wait()


def test_supervisor_kills_a_worker_stuck_in_one_step():
    """A worker that heartbeats but has been inside one step past --max-step-seconds is
    killed like a silent one; below it, or with the knob at 0, it is left alone."""
    from triptych.config import EngineConfig

    for off in (Supervisor("ipc:///x", None, lambda w, c: None, max_step_s=0.0),
                Supervisor("ipc:///x", None, lambda w, c: None, max_step_s=5.0)):
        w = WorkerHandle("colocated", 0, {})
        w.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
        try:
            w.state, w.last_seen, w.busy_s = "up", 100.0, 4.0  # heartbeating, in a step
            off.workers.append(w)
            off._stopping = True
            off.check(100.2)
            assert w.state == "up"
            w.busy_s = 6.0
            off.check(100.4)
            assert w.state == ("up" if off.max_step_s == 0 else "stalled")
            if off.max_step_s:
                w.proc.wait(30)  # a hang guard
                off.check(100.6)
                assert w.state == "dead" and w.proc.returncode == -9
        finally:
            if w.proc.poll() is None:
                w.proc.kill()
                w.proc.wait()
    for name in ("max_step_seconds", "first_token_timeout"):
        assert getattr(EngineConfig(model="x", **{name: 0}), name) == 0
        for bad in (0.5, -1.0, float("nan")):
            with pytest.raises(ValueError, match=name):
                EngineConfig(model="x", **{name: bad})


# -- a tensor-parallel rank's death is the worker's, not the request's ------------------------
def test_rank_death_during_message_handling_ends_the_worker():
    from triptych.parallel.context import TPGroupError
    from triptych.worker.loop import Handler, _receive

    class Broken(Handler):
        def __init__(self, exc: Exception) -> None:
            self.exc = exc

        def handle(self, msg, frames):
            raise self.exc

    frames = wire.encode(wire.AbortRequest(["r1"]))
    with pytest.raises(TPGroupError):  # the loop ends: the router migrates its requests
        _receive(Broken(TPGroupError("rank 1 died")), frames)
    add = wire.encode(wire.AddRequest("r2", [1, 2], _params()))
    replies = _receive(Broken(KeyError("bug")), add)  # our bug: that request only
    assert [type(r) for r in replies] == [wire.RequestError]
    assert replies[0].request_id == "r2" and not replies[0].retryable


def _params():
    from triptych.engine.sample.sampling_params import SamplingParams

    return SamplingParams(max_tokens=1)


# -- two failure reports for one attempt ----------------------------------------------------
def test_two_failure_reports_of_one_attempt_start_one_new_attempt():
    from triptych.router.errors import Retry
    from triptych.router.migration import Migration
    from triptych.router.requests import Child, ClientRequest, RequestTable

    async def run() -> None:
        gate = asyncio.Event()
        runs: list[str] = []

        class Dispatcher:
            async def run(self, a):
                runs.append(a.core_id)
                if a.core_id.endswith("@0"):
                    await gate.wait()  # the first attempt's path is awaiting...
                    raise Retry("no reservation came")  # ...and then fails as well

        class Pixels:
            async def reset(self, w):
                pass

        table = RequestTable(lambda pins: None)
        m = Migration(table, Dispatcher(), None, Pixels(), lambda cid: [])
        w = WorkerHandle("colocated", 0, {})
        w.state = "up"
        request = ClientRequest("req", None, asyncio.Queue())
        c = Child("req-0", _params(), request)
        table.add(request, [c])
        m.start(c)
        await asyncio.sleep(0)  # the first attempt's path runs up to its await
        first = c.attempt
        first.worker = w
        m.retry(first, "w: transfer failed")  # report 1 (a retryable RequestError)
        m.on_worker_exit(w)  # report 2: the same worker died (it no longer holds it)
        m.retry(first, "late report")  # report 3: the same attempt again
        gate.set()  # report 4: the first attempt's own path raises Retry after its await
        for _ in range(100):
            await asyncio.sleep(0)
        assert runs == ["req-0@0", "req-0@1"], runs
        assert c.migrations == 1 and m.migrations_total == 1
        assert c.attempt.core_id == "req-0@1" and not c.attempt.ended
        assert request.queue.empty()  # nothing failed the request

    from unittest import mock

    with mock.patch("triptych.connector.cleanup_stale", lambda: None):
        asyncio.run(run())


# -- who may join ---------------------------------------------------------------------------
def _registry():
    from triptych.config import EngineConfig
    from triptych.router.layout import Layout
    from triptych.router.registry import WorkerRegistry

    layout = Layout.from_config(EngineConfig(model="x", prefill_workers=1, decode_workers=1))
    reg = WorkerRegistry(layout, 4, lambda w, code: None, 10.0, model_fingerprint="abc123")
    local = reg.add_local("decode", 0, {}, 1)
    local.state = "up"
    return reg, local


def _hello(ident: str, fp: str = "abc123") -> wire.Hello:
    return wire.Hello(ident, "decode", 1, 64, 8, model_fingerprint=fp)


def test_a_remote_worker_named_like_a_local_one_is_refused():
    reg, local = _registry()
    assert reg.register_remote("decode-0#x1", _hello("decode-0#x1")) is None
    assert reg._by_name["decode-0"] is local and local.up and len(reg.workers) == 1
    assert reg.current("decode-0#x1", remote=True) is None
    assert "local worker" in reg.refused["decode-0#x1"]
    w = reg.register_remote("decode-h2#x1", _hello("decode-h2#x1"))  # its own name: joins
    assert w is not None and w.up and reg.current("decode-h2#x1", remote=True) is w


def test_a_remote_worker_with_another_checkpoint_is_refused():
    reg, _ = _registry()
    for fp in ("def456", ""):
        assert reg.register_remote("decode-h3#x", _hello("decode-h3#x", fp)) is None
        assert "another checkpoint" in reg.refused["decode-h3#x"]
    assert [w.name for w in reg.workers] == ["decode-0"]


def test_model_fingerprint_tells_checkpoints_apart(tmp_path):
    import json
    import struct

    from triptych.worker.fingerprint import model_fingerprint

    def ckpt(d, values):
        d.mkdir()
        (d / "config.json").write_text(json.dumps({"hidden_size": 8}))
        header = json.dumps({"w": {"dtype": "F32", "shape": [len(values)],
                                   "data_offsets": [0, 4 * len(values)]}}).encode()
        (d / "model.safetensors").write_bytes(struct.pack("<Q", len(header)) + header
                                              + struct.pack(f"<{len(values)}f", *values))
        return str(d)

    a = ckpt(tmp_path / "a", [1.0, 2.0, 3.0, 4.0])
    a2 = ckpt(tmp_path / "a2", [1.0, 2.0, 3.0, 4.0])
    shape = ckpt(tmp_path / "b", [1.0] * 6)  # another shape
    weights = ckpt(tmp_path / "c", [1.0, 2.0, 3.0, 5.0])  # same shape, other weights
    assert model_fingerprint(a) == model_fingerprint(a2)
    assert len({model_fingerprint(p) for p in (a, shape, weights)}) == 3
    assert model_fingerprint(str(tmp_path / "missing")) == ""


def test_a_public_key_others_could_replace_is_not_trusted(tmp_path):
    from triptych.connector import ConnectorError
    from triptych.connector.auth import generate_keys, load_keys

    d = str(tmp_path / "keys")
    generate_keys(d, ["router", "decode-h2"])
    assert "decode-h2" in load_keys(d, "router").peers
    key = os.path.join(d, "public", "decode-h2.key")
    os.chmod(key, 0o666)  # world-writable: anyone could swap in their own key
    with pytest.raises(ConnectorError, match="writable by no one else"):
        load_keys(d, "router")
    os.chmod(key, 0o644)
    os.chmod(os.path.join(d, "public"), 0o777)  # or the folder: a key could be added
    with pytest.raises(ConnectorError, match="public key folder"):
        load_keys(d, "router")
    os.chmod(os.path.join(d, "public"), 0o755)
    assert "decode-h2" in load_keys(d, "router").peers


def test_segment_names_are_unguessable():
    from triptych.connector import make_connector
    from triptych.connector.segments import name_pattern

    c = make_connector("shm", name="names", header_type=wire.DataMsg)
    try:
        _, a, _ = c._pack("", [torch_ones()])
        _, b, _ = c._pack("", [torch_ones()])
        for f in (a, b):
            assert name_pattern(c.prefix).match(f["segment"])
        tail = [f["segment"].rsplit("-", 1)[1] for f in (a, b)]
        assert tail[0] != tail[1] and all(len(t) == 16 for t in tail)  # 64 random bits each
    finally:
        for f in (a, b):
            c._pack_failed("", f)
        c.close()


def torch_ones():
    import torch

    return torch.ones(4)
