"""A frozen worker is noticed (issue 15, point 2): two colocated replicas, one of them
``kill -STOP``'d while it streams a request. Its heartbeat stops with it; past
--worker-heartbeat-timeout the supervisor SIGKILLs it, the request goes on from the other
replica to its full length, /health shows the frozen one replaced (a new pid), and nothing
the test started is left behind (SIGCONT, then the server's own cleanup)."""
from __future__ import annotations

import os
import signal
import sys
import threading

import httpx

sys.path.insert(0, os.path.dirname(__file__))
from server_fixtures import ServerProc, alive, text_part, user, wait_for

# The tiny model writes ~1,000 tokens/s on this box: the request must still be running when
# the test finds its worker and freezes it (200 tokens were gone in 0.2 s, and a busy CI box
# once missed that window). 6,000 tokens leave seconds, and a busy box slows both alike.
N_TOKENS = 6000


def _health(s: ServerProc) -> dict:
    return httpx.get(s.base + "/health", timeout=5).json()


def _stream(s: ServerProc, out: dict) -> None:
    """Stream a greedy chat; count the chunks (the test waits for some before freezing)."""
    out.update(chunks=0, text="", error=None)
    try:
        client = s.openai_client(timeout=300)  # a hang guard, not a speed claim
        stream = client.chat.completions.create(
            model="tiny", messages=user(text_part("Tell me a long story about a fox.")),
            stream=True, temperature=0, max_tokens=N_TOKENS, extra_body={"ignore_eos": True},
            stream_options={"include_usage": True})
        for chunk in stream:
            if chunk.choices and chunk.choices[0].delta.content:
                out["chunks"] += 1
                out["text"] += chunk.choices[0].delta.content
            if chunk.usage is not None:
                out["usage"] = chunk.usage
    except Exception as e:  # noqa: BLE001 (the test inspects what the client saw)
        out["error"] = e


def _holder(s: ServerProc) -> dict | None:
    for w in _health(s)["pools"]["colocated"]["workers"]:
        if w["requests"] > 0 and w["state"] == "up":
            return w
    return None


def test_a_frozen_worker_is_killed_replaced_and_its_request_finishes(tiny_qwen2_vl, tmp_path):
    s = ServerProc(tiny_qwen2_vl, tmp_path / "serve.log", "--block-size", "4",
                   "--max-model-len", "8192", "--data-parallel-size", "2",
                   "--worker-heartbeat-timeout", "3", "--served-model-name", "tiny")
    frozen = None
    try:
        h = _health(s)
        assert all(w["silent_s"] is not None for w in h["pools"]["colocated"]["workers"])
        assert h["supervisor"]["state"] == "ok" and h["stalled"] == []
        out: dict = {}
        t = threading.Thread(target=_stream, args=(s, out))
        t.start()
        wait_for(lambda: out.get("chunks", 0) >= 3, "the first tokens")
        victim = wait_for(lambda: _holder(s) or (None if t.is_alive() else {"gone": 1}),
                          "the worker holding the request")
        assert "pid" in victim, "the request ended before the test could freeze its worker"
        frozen = victim["pid"]
        os.kill(frozen, signal.SIGSTOP)
        t.join(300)  # a hang guard: without liveness the stream would wait forever
        assert not t.is_alive(), "the stream of a frozen worker's request hung"
        assert out["error"] is None, out["error"]
        assert out["usage"].completion_tokens == N_TOKENS
        # the frozen worker was killed (not merely left stopped) and replaced
        wait_for(lambda: not alive(frozen), "the frozen worker to be killed")
        w = wait_for(lambda: next((w for w in _health(s)["pools"]["colocated"]["workers"]
                                   if w["index"] == victim["index"] and w["state"] == "up"),
                                  None), "the replacement")
        assert w["pid"] != frozen and w["restarts"] == 1
        assert s.metric("triptych:request_migrations_total") >= 1
        log = s.log_path.read_text()
        assert "sent no heartbeat" in log
        wait_for(lambda: _health(s)["status"] == "ok", "every worker up again", timeout=120)
    finally:
        if frozen is not None and alive(frozen):
            os.kill(frozen, signal.SIGCONT)
        s.stop(signal.SIGTERM, timeout=60)
        s.cleanup_descendants()


def test_the_heartbeat_goes_on_while_the_loop_is_inside_a_long_step():
    """The heartbeat comes from a thread: while the main thread is inside a step (here a
    blocking call that releases the GIL, as torch's ops do) heartbeats keep coming, and
    they say how long the step has run."""
    import time

    import msgspec
    import zmq
    from triptych.worker import wire
    from triptych.worker.heartbeat import HeartbeatThread

    ctx = zmq.Context()
    router = ctx.socket(zmq.ROUTER)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    hb = HeartbeatThread(ctx, "colocated-0#0", f"tcp://127.0.0.1:{port}", interval_s=0.05)
    try:
        hb.start()
        hb.step_begins()
        time.sleep(1.0)  # NOTE: the "long step" itself, not a synchronisation
        beats = []
        while router.poll(0):
            ident, frame = router.recv_multipart()
            beats.append(msgspec.msgpack.decode(frame, type=wire.Heartbeat))
        assert ident == b"colocated-0#0" + wire.HEARTBEAT_SUFFIX.encode()
        assert len(beats) >= 3, "heartbeats must go on while the step runs"
        assert beats[-1].busy_s > beats[0].busy_s > 0 or beats[0].busy_s == 0 < beats[-1].busy_s
        hb.step_ends()
        router.setsockopt(zmq.RCVTIMEO, 30_000)  # a hang guard
        while True:  # after the step: a beat that says idle
            _, frame = router.recv_multipart()
            if msgspec.msgpack.decode(frame, type=wire.Heartbeat).busy_s == 0:
                break
    finally:
        hb.stop()
        router.close(0)
        ctx.term()
