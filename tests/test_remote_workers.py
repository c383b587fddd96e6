"""Workers on other hosts (here: other processes on 127.0.0.1, tcp + CURVE): a `triptych
worker` joins the decode pool of a running server and serves requests (outputs equal the
offline engine); a worker whose key the router does not know never joins; a known key that
claims another node's name is ignored; a dead remote worker is noticed and left."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time

import httpx
import msgspec
import pytest
import zmq
from triptych import LLM, SamplingParams

sys.path.insert(0, os.path.dirname(__file__))
from server_fixtures import ServerProc, alive, free_port, text_part, user


def _health(s: ServerProc) -> dict:
    return httpx.get(s.base + "/health", timeout=5).json()


def _decode_workers(s: ServerProc) -> list[dict]:
    return _health(s)["pools"]["decode"]["workers"]


def _wait(pred, timeout: float) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if pred():
            return True
        time.sleep(0.25)
    return pred()


def _worker(model: str, keys: str, name: str, router: str, log) -> subprocess.Popen:
    return subprocess.Popen(
        [sys.executable, "-m", "triptych", "worker", "--pool", "decode", "--name", name,
         "--router", router, "--model", model, "--block-size", "4", "--max-model-len", "512",
         "--kv-transfer", "tcp", "--worker-keys", keys, "--threads", "1"],
        stdout=log, stderr=subprocess.STDOUT)


def test_a_worker_on_another_host_joins_and_serves(tiny_qwen2_vl, tmp_path):
    from triptych.connector.auth import generate_keys, load_keys, secure_client

    keys = str(tmp_path / "keys")
    generate_keys(keys, ["router", "prefill-0", "decode-0", "decode-h2"])
    rogue = str(tmp_path / "rogue")  # a key the router was never given
    generate_keys(rogue, ["decode-h3"])
    shutil.copy(f"{keys}/public/router.key", f"{rogue}/public/router.key")
    port = free_port()
    router = f"tcp://127.0.0.1:{port}"
    s = ServerProc(tiny_qwen2_vl, tmp_path / "serve.log", "--block-size", "4",
                   "--max-model-len", "512", "--prefill-workers", "1", "--decode-workers",
                   "1", "--kv-transfer", "tcp", "--worker-address", router,
                   "--worker-keys", keys, "--served-model-name", "tiny")
    log = open(tmp_path / "workers.log", "w")  # noqa: SIM115
    procs: list[subprocess.Popen] = []
    try:
        procs.append(_worker(tiny_qwen2_vl, keys, "decode-h2", router, log))
        procs.append(_worker(tiny_qwen2_vl, rogue, "decode-h3", router, log))
        assert _wait(lambda: len([w for w in _decode_workers(s) if w["state"] == "up"]) == 2,
                     120), (tmp_path / "workers.log").read_text()[-3000:]
        names = {w["name"]: w for w in _decode_workers(s)}
        assert set(names) == {"decode-0", "decode-h2"} and names["decode-h2"]["remote"]

        # A valid key that claims another node's name: its messages are dropped.
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IDENTITY, b"decode-0#1")
        secure_client(sock, load_keys(keys, "decode-h2"), load_keys(keys, "router").public)
        sock.connect(router)
        from triptych.worker import wire
        sock.send_multipart(wire.encode(wire.Hello("decode-0#1", "decode", 1, 512, 10)))
        sock.send_multipart([msgspec.msgpack.encode({"type": "stats", "values": {"x": 1}})])
        time.sleep(1.0)
        sock.close(0)
        ctx.term()
        assert {w["name"] for w in _decode_workers(s)} == {"decode-0", "decode-h2"}
        assert _decode_workers(s)[0]["pid"] != 1

        # Requests spread over both decode workers (least outstanding work); the remote
        # one serves its share, and every output equals the offline engine's.
        import concurrent.futures as cf
        offline = LLM(tiny_qwen2_vl, block_size=4, max_model_len=512)
        convs = [user(text_part(f"Request {i}: say something.")) for i in range(6)]
        wants = [o.outputs[0].text for o in offline.chat(
            convs, SamplingParams(temperature=0, max_tokens=24, ignore_eos=True),
            use_tqdm=False)]

        def ask(msgs: list[dict]) -> str:
            r = httpx.post(s.base + "/v1/chat/completions", timeout=120, json={
                "messages": msgs, "max_tokens": 24, "temperature": 0, "ignore_eos": True})
            assert r.status_code == 200, r.text
            return r.json()["choices"][0]["message"]["content"]

        with cf.ThreadPoolExecutor(6) as ex:
            assert list(ex.map(ask, convs)) == wants
        served = {w["name"]: w["served"] for w in _decode_workers(s)}
        assert served["decode-h2"] >= 1 and served["decode-0"] >= 1, served
        assert _wait(lambda: s.metric("triptych:kv_transfer_bytes_total") > 0, 60)

        # The remote worker dies: the router notices (no heartbeat) and stops using it.
        procs[0].kill()
        procs[0].wait(10)
        assert _wait(lambda: {w["name"]: w["state"] for w in _decode_workers(s)}
                     .get("decode-h2") == "dead", 60)  # hang guards, not speed claims
        assert _health(s)["status"] == "degraded"
        r = httpx.post(s.base + "/v1/chat/completions", timeout=60,
                       json={"messages": user(text_part("still up?")), "max_tokens": 3})
        assert r.status_code == 200
        assert procs[1].poll() is None or "decode-h3" not in {w["name"] for w in
                                                               _decode_workers(s)}
    finally:
        for p in procs:
            p.kill()
            p.wait(10)
        log.close()
        s.stop(signal.SIGTERM)
        s.cleanup_descendants()
    assert not any(alive(p.pid) for p in procs)


@pytest.mark.parametrize("address", ["127.0.0.1:7000", "ipc:///tmp/x"])
def test_worker_address_must_be_tcp_with_keys(address):
    from triptych.config import EngineConfig
    with pytest.raises(ValueError, match="worker_address"):
        EngineConfig(model="x", decode_workers=1, worker_address=address, worker_keys="k")
    with pytest.raises(ValueError, match="worker_keys"):
        EngineConfig(model="x", decode_workers=1, worker_address="tcp://127.0.0.1:7000")
