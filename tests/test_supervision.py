"""Fault isolation and process supervision (issue 7): one request's failure ends that
request only; garbage on any socket changes nothing; a dead worker is noticed, its
requests fail fast (or move to a live worker and continue), it is restarted; stopping or
killing the server leaves no process and no directory behind."""
from __future__ import annotations

import glob
import os
import re
import signal
import sys
import tempfile
import threading
import time

import httpx
import msgspec
import pytest
import zmq

sys.path.insert(0, os.path.dirname(__file__))
from server_fixtures import (
    ServerProc,
    _children,
    alive,
    module_server,
    separated_prompt,
    text_part,
    user,
)



# -- in-process: the worker's message handling and the engine core's step isolation ----------
def test_worker_survives_wire_garbage(tiny_qwen2_vl):
    """What a worker does with each message (worker_loop._receive -> DecodeWorker.handle):
    garbage is dropped or refused per request, and the worker still serves afterwards."""
    from triptych.decode.worker import DecodeWorker
    from triptych.worker import wire
    from triptych.engine.sample.sampling_params import SamplingParams
    from triptych.worker.loop import WorkerSpec, _receive

    spec = WorkerSpec(worker_id="decode-0#0", pool="decode", router_address="ipc:///nowhere",
                      config={"model": tiny_qwen2_vl, "block_size": 4, "max_model_len": 256,
                                  "kv_cache_memory": "16MiB"})
    socket_dirs = os.path.join(tempfile.gettempdir(), f"triptych-{os.getpid()}-ipc-*")
    before = set(glob.glob(socket_dirs))
    worker = DecodeWorker(spec)
    sp = SamplingParams(temperature=0, max_tokens=2)
    item = wire.WireMMItem("image", "h", 1, 4, [1, 4, 4], wire.TensorMeta("float32", [16, 8]))
    forged = [
        [b"\xff\x00garbage"],  # not msgpack
        [msgspec.msgpack.encode({"type": "add"})],  # missing fields
        [msgspec.msgpack.encode({"type": "nope"})],  # unknown tag
        wire.encode(wire.AddRequest("r1", [1, 2, 3], sp, [item])),  # tensor frame missing
        wire.encode(wire.AddRequest("r2", [1, 2, 3], sp, [item])) + [b"\0" * 7],  # wrong size
        wire.encode(wire.AddRequest("r3", [1, 2, 3], sp, [wire.WireMMItem(
            "image", "h", 1, 4, [1, 4, 4], wire.TensorMeta("float32", [2**32, 2**32]))]))
        + [b""],  # a shape whose size overflows int64
        wire.encode(wire.AddRequest("r4", [1, 2, 3], sp, [wire.WireMMItem(
            "image", "h", 1, 4, [1, 4, 4], wire.TensorMeta("int64", [16, 8]))]))
        + [b"\0" * 1024],  # dtype not allowed
        wire.encode(wire.AddRequest("r5", [1, 2, 3], sp, [item])) + [b"\0" * 512],  # placeholder
        wire.encode(wire.AddRequest("r6", [10**9], sp)),  # token id beyond the vocab
        wire.encode(wire.AddRequest("r7", [], sp)),  # empty prompt
        wire.encode(wire.AddRequest("r8", [1, 2, 3], sp, [wire.WireMMItem(
            "image", "never-sent", 1, 4, [1, 4, 4])])),  # no pixels, nothing cached
        [msgspec.msgpack.encode({"type": "add", "request_id": "r9", "prompt_token_ids": [1],
                                 "params": {"temperature": float("nan")}})],  # NaN
        wire.encode(wire.AddRequest("r10", [1, 2, 3], sp, output_token_ids=[-1])),
        wire.encode(wire.AbortRequest(["never-added"])),
    ]
    try:
        sent = []
        for frames in forged:
            sent += _receive(worker, frames)
        errors = {m.request_id for m in sent if isinstance(m, wire.RequestError)}
        assert errors == {f"r{i}" for i in range(1, 11)}
        assert not worker.has_work()
        assert not _receive(worker, wire.encode(wire.AddRequest("ok", [1, 2, 3], sp)))
        outs = []
        while worker.has_work():
            outs += [o for m in worker.step() for o in m.outputs]
        assert [o.request_id for o in outs] == ["ok", "ok"]
        assert outs[-1].finish_reason == "length"
    finally:
        worker.close()  # its data endpoint's socket directory
    assert set(glob.glob(socket_dirs)) <= before


def test_a_failing_step_ends_only_the_request_that_causes_it(tiny_qwen2_vl, monkeypatch):
    """A fault that only one request triggers (simulated in the model's forward, since
    validation keeps real bad input out) fails that request; its batch-mates finish with
    the tokens of an undisturbed run."""
    from triptych import LLM, SamplingParams

    llm = LLM(tiny_qwen2_vl, block_size=4, max_num_seqs=8)
    sp = SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    prompts = [[5, 6, 7, 8, 9], [11, 12, 13], [21, 22, 23, 24]]
    clean = [o.outputs[0].token_ids for o in llm.generate(prompts, sp, use_tqdm=False)]
    poison = 99  # a token id only the bad request holds
    model = llm.engine.core.model
    real_forward = model.forward

    def forward(input_ids, positions, inputs_embeds=None):
        if bool((input_ids == poison).any()):
            raise RuntimeError("simulated kernel fault")
        return real_forward(input_ids, positions, inputs_embeds)

    monkeypatch.setattr(model, "forward", forward)
    outs = llm.generate(prompts[:2] + [[poison, 1, 2]] + prompts[2:], sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs[:2] + outs[3:]] == clean
    assert outs[2].outputs[0].finish_reason == "error" and outs[2].error
    assert llm.engine.core.num_failed_steps >= 1
    llm.engine.kv.check_integrity()
    assert not llm.engine.has_unfinished_requests()


def test_stale_run_dirs_of_dead_servers_are_removed(tmp_path):
    from triptych.router.supervisor import clean_stale

    dead = subprocess_pid_that_exited()
    (tmp_path / f"triptych-{dead}-abc").mkdir()
    hour_ago = time.time() - 3600  # (a dir without an owner lock: an older server's)
    os.utime(tmp_path / f"triptych-{dead}-abc", (hour_ago, hour_ago))
    (tmp_path / f"triptych-{os.getpid()}-def").mkdir()  # a live server's: kept
    (tmp_path / "unrelated").mkdir()
    assert clean_stale(str(tmp_path)) == [f"triptych-{dead}-abc"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"triptych-{os.getpid()}-def",
                                                         "unrelated"]


def subprocess_pid_that_exited() -> int:
    import subprocess
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


# -- against the real server --------------------------------------------------------------
def _stream_text(client, messages, max_tokens: int, out: dict, key: str) -> None:
    """Stream a greedy chat; record the text, the time each chunk came, and any error."""
    out[key] = {"text": "", "times": [], "error": None}
    try:
        s = client.chat.completions.create(model="tiny", messages=messages, stream=True,
                                           temperature=0, max_tokens=max_tokens,
                                           extra_body={"ignore_eos": True})
        for chunk in s:
            if chunk.choices and chunk.choices[0].delta.content:
                out[key]["text"] += chunk.choices[0].delta.content
                out[key]["times"].append(time.time())
    except Exception as e:  # noqa: BLE001 (the test inspects what the client saw)
        out[key]["error"] = e
        out[key]["error_time"] = time.time()


def _wait(pred, timeout: float, step: float = 0.1) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return True
        time.sleep(step)
    return pred()


def _health(s: ServerProc) -> dict:
    return httpx.get(s.base + "/health", timeout=5).json()


def _worker_with_requests(s: ServerProc) -> dict | None:
    for p in _health(s)["pools"].values():
        for w in p["workers"]:
            if w["requests"] > 0 and w["state"] == "up":
                return w
    return None


def _all_descendants(s: ServerProc) -> list[int]:
    return sorted(set(s.descendants) | set(_children(s.proc.pid)))


@pytest.fixture(scope="module")
def one_worker(tiny_qwen2_vl, tmp_path_factory):
    yield from module_server(tiny_qwen2_vl, tmp_path_factory,
                             "--block-size", "4", "--max-model-len", "2048",
                             "--served-model-name", "tiny")


def test_garbage_on_the_router_socket_changes_nothing(one_worker):
    sockets = re.findall(r"sockets in (\S+)", one_worker.log_path.read_text())[0]
    ctx = zmq.Context()
    try:
        for ident in (b"stranger", b"colocated-0#0", b"colocated-0#7"):  # spoofed too
            sock = ctx.socket(zmq.DEALER)
            sock.setsockopt(zmq.IDENTITY, ident)
            # close() delivers what was sent (the live worker's own name is refused: no wait)
            sock.setsockopt(zmq.LINGER, 0 if ident == b"colocated-0#0" else 60_000)
            sock.connect(f"ipc://{sockets}/router")
            for frames in ([b"\xff\xfe"], [b""], [msgspec.msgpack.encode({"type": "outputs"})],
                           [msgspec.msgpack.encode({"type": "outputs", "outputs": [
                               ["chatcmpl-x", [1]]]})], [b"x"] * 50):
                sock.send_multipart(frames)
            sock.close()
    finally:
        ctx.term()  # returns once every socket has handed its messages over
    # The router has read the last socket's garbage (it logs each message it drops).
    assert _wait(lambda: one_worker.log_path.read_text().count(
        "dropped a malformed message from 'colocated-0#7'") >= 4, 60)
    assert _health(one_worker)["status"] == "ok"
    r = httpx.post(one_worker.base + "/v1/chat/completions", timeout=60,
                   json={"messages": user(text_part("still there?")), "max_tokens": 3})
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


def test_engine_death_fails_in_flight_fast_then_restarts(one_worker):
    client = one_worker.openai_client(timeout=60)
    out: dict = {}
    t = threading.Thread(target=_stream_text,
                         args=(client, user(text_part("Tell me a long story.")), 1500, out, "a"))
    t.start()
    assert _wait(lambda: "a" in out and len(out["a"]["times"]) >= 3, 60)
    pid = one_worker.engine_pid()
    os.kill(pid, signal.SIGKILL)
    t.join(60)  # a hang guard
    assert not t.is_alive()
    assert out["a"]["error"] is not None, "the stream must end with an error, not hang"
    # /metrics counts the restart, and the next request succeeds once the supervisor has
    # restarted the worker. (/health while no worker lives: 503, tested with the router.)
    assert _wait(lambda: _health(one_worker)["status"] == "ok", 120, 0.5)
    w = _health(one_worker)["pools"]["colocated"]["workers"][0]
    assert w["restarts"] == 1 and w["pid"] != pid and not alive(pid)
    r = httpx.post(one_worker.base + "/v1/chat/completions", timeout=60,
                   json={"messages": user(text_part("after the restart")), "max_tokens": 3})
    assert r.status_code == 200
    assert one_worker.metric("triptych:worker_restarts_total") == 1


def test_sigterm_stops_everything_in_time(one_worker):
    """Runs last for this server: SIGTERM ends P0 and every worker (generous deadlines
    against hangs), and the socket dir is gone."""
    sockets = re.findall(r"sockets in (\S+)", one_worker.log_path.read_text())[0]
    procs = _all_descendants(one_worker)
    assert procs
    one_worker.stop(signal.SIGTERM, timeout=60)
    assert _wait(lambda: not any(alive(p) for p in procs), 60)
    assert one_worker.proc.returncode is not None
    assert not os.path.exists(sockets)


def test_a_dead_decode_worker_hands_its_stream_to_another(tiny_qwen2_vl, tmp_path):
    """Two colocated replicas: kill -9 the one streaming a greedy request; the stream goes
    on from the other and its full text equals an undisturbed run; a concurrent request on
    the healthy replica is untouched; the killed one is restarted. Then SIGINT (Ctrl-C)
    stops everything."""
    from triptych import LLM, SamplingParams

    n_a, n_b = 500, 300
    offline = LLM(tiny_qwen2_vl, block_size=4, max_model_len=2048)
    msgs_a, ref_a = separated_prompt(offline, [
        user(text_part(f"Tell me a long story about a fox, number {i}.")) for i in range(12)], n_a)
    msgs_b = user(text_part("Describe a quiet lake at dawn."))
    ref = {"a": ref_a, "b": offline.chat(msgs_b, SamplingParams(
        temperature=0, max_tokens=n_b, ignore_eos=True), use_tqdm=False)[0].outputs[0].text}
    del offline
    s = ServerProc(tiny_qwen2_vl, tmp_path / "serve.log", "--block-size", "4",
                   "--max-model-len", "2048", "--data-parallel-size", "2",
                   "--served-model-name", "tiny")
    try:
        client = s.openai_client(timeout=120)
        out: dict = {}
        ta = threading.Thread(target=_stream_text, args=(client, msgs_a, n_a, out, "a"))
        ta.start()
        assert _wait(lambda: "a" in out and len(out["a"]["times"]) >= 5, 60)
        victim = _worker_with_requests(s)
        assert victim is not None
        tb = threading.Thread(target=_stream_text, args=(client, msgs_b, n_b, out, "b"))
        tb.start()
        assert _wait(lambda: "b" in out and len(out["b"]["times"]) >= 1, 60)
        os.kill(victim["pid"], signal.SIGKILL)
        ta.join(120)
        tb.join(120)
        assert not ta.is_alive() and not tb.is_alive()
        assert out["a"]["error"] is None and out["b"]["error"] is None
        assert out["a"]["text"] == ref["a"], "the resumed stream must equal an undisturbed run"
        assert out["b"]["text"] == ref["b"]
        assert s.metric("triptych:request_migrations_total") >= 1
        assert _wait(lambda: _health(s)["status"] == "ok", 120, 0.5)
        assert sum(w["restarts"] for w in _health(s)["pools"]["colocated"]["workers"]) == 1
        procs = _all_descendants(s)
        assert s.stop(signal.SIGINT, timeout=60) == 0
        assert _wait(lambda: not any(alive(p) for p in procs), 60)
        assert "Traceback" not in s.log_path.read_text()
    finally:
        s.stop(signal.SIGKILL)
        s.cleanup_descendants()

