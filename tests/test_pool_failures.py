"""Pool workers that die (kill -9) mid-request, against a real 2e2p2d `triptych serve`:
a stream on a dead decode worker continues on the other one and its full text equals an
undisturbed run; requests on a dead prefill or encode worker run again; a concurrent
request is untouched; the dead workers are restarted; and when P0 itself is killed nothing
of any pool is left (processes, shared memory, socket dirs)."""
from __future__ import annotations

import glob
import os
import re
import signal
import sys
import threading
import time

import httpx
import pytest
from triptych import LLM, SamplingParams

sys.path.insert(0, os.path.dirname(__file__))
from server_fixtures import (
    ServerProc,
    _children,
    alive,
    data_url,
    image_part,
    img,
    module_server,
    png,
    separated_prompt,
    text_part,
    user,
)

MAX_LEN = 2048


@pytest.fixture(scope="module")
def server(tiny_qwen2_vl, tmp_path_factory):
    yield from module_server(tiny_qwen2_vl, tmp_path_factory,
                             "--block-size", "4", "--max-model-len", str(MAX_LEN),
                             "--max-num-batched-tokens", "16", "--encode-workers", "2",
                             "--prefill-workers", "2", "--decode-workers", "2",
                             "--served-model-name", "tiny")


@pytest.fixture(scope="module")
def offline(tiny_qwen2_vl):
    return LLM(tiny_qwen2_vl, block_size=4, max_model_len=MAX_LEN)


@pytest.fixture(scope="module")
def client(server):
    return server.openai_client(timeout=180)


def want(offline: LLM, msgs: list[dict], n: int) -> str:
    return offline.chat(msgs, SamplingParams(temperature=0, max_tokens=n, ignore_eos=True),
                        use_tqdm=False)[0].outputs[0].text


def stream(client, msgs: list[dict], n: int, out: dict, key: str) -> None:
    out[key] = {"text": "", "chunks": 0, "error": None}
    try:
        for c in client.chat.completions.create(model="tiny", messages=msgs, stream=True,
                                                temperature=0, max_tokens=n,
                                                extra_body={"ignore_eos": True}):
            if c.choices and c.choices[0].delta.content:
                out[key]["text"] += c.choices[0].delta.content
                out[key]["chunks"] += 1
    except Exception as e:  # noqa: BLE001 (the test looks at what the client saw)
        out[key]["error"] = e


def busy_worker(s: ServerProc, pool: str, timeout: float) -> dict | None:
    """The first worker of ``pool`` seen holding a request (polled)."""
    deadline = time.time() + timeout
    while time.time() < deadline:
        for w in httpx.get(s.base + "/health", timeout=5).json()["pools"][pool]["workers"]:
            if w["requests"] and w["state"] == "up":
                return w
        time.sleep(0.005)
    return None


def wait_ok(s: ServerProc, timeout: float = 180) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if httpx.get(s.base + "/health", timeout=5).json()["status"] == "ok":
            return True
        time.sleep(0.5)
    return False


def kill_mid_stream(s: ServerProc, msgs: list[dict], n: int) -> dict:
    """Stream ``msgs`` (n tokens), kill -9 the decode worker holding it after 5 chunks, and
    return the finished stream ({"text", "error", "chunks"}) once it ends elsewhere."""
    client = s.openai_client(timeout=180)
    out: dict = {}
    t = threading.Thread(target=stream, args=(client, msgs, n, out, "a"))
    t.start()
    deadline = time.time() + 120
    while time.time() < deadline and not ("a" in out and out["a"]["chunks"] >= 5):
        time.sleep(0.02)
    victim = busy_worker(s, "decode", 10)
    assert victim is not None
    os.kill(victim["pid"], signal.SIGKILL)
    t.join(180)
    return out["a"]


def restarts(s: ServerProc, pool: str) -> int:
    return sum(w["restarts"] for w in
               httpx.get(s.base + "/health", timeout=5).json()["pools"][pool]["workers"])


def test_a_dead_decode_worker_hands_its_stream_to_the_other(server, client, offline):
    a, ref_a = separated_prompt(offline, [user(image_part(data_url(png(img(11 + i, 56, 84)))),
                                               text_part("Tell me a long story."))
                                          for i in range(12)], 500)
    b = user(text_part("Describe a quiet lake at dawn."))
    ref_b = want(offline, b, 300)
    out: dict = {}
    ta = threading.Thread(target=stream, args=(client, a, 500, out, "a"))
    ta.start()
    deadline = time.time() + 120
    while time.time() < deadline and not ("a" in out and out["a"]["chunks"] >= 5):
        time.sleep(0.02)
    victim = busy_worker(server, "decode", 60)
    assert victim is not None
    tb = threading.Thread(target=stream, args=(client, b, 300, out, "b"))
    tb.start()
    while time.time() < deadline and not ("b" in out and out["b"]["chunks"] >= 1):
        time.sleep(0.02)
    os.kill(victim["pid"], signal.SIGKILL)
    ta.join(180)
    tb.join(180)
    assert out["a"]["error"] is None and out["b"]["error"] is None
    assert out["a"]["text"] == ref_a, "the stream resumed on the other decode worker"
    assert out["b"]["text"] == ref_b
    assert server.metric("triptych:request_migrations_total") >= 1
    assert wait_ok(server) and restarts(server, "decode") == 1


@pytest.mark.parametrize("pool", ["prefill", "encode"])
def test_requests_on_a_dead_worker_run_again(server, client, offline, pool):
    # Long prompts, several images and a 16-token step budget keep requests on the
    # encode and prefill workers long enough to be caught there.
    seed = 100 if pool == "encode" else 30  # images no worker holds yet
    reqs = [user(image_part(data_url(png(img(seed + i, 112, 112)))),
                 image_part(data_url(png(img(seed + 10 + i, 84, 112)))),
                 text_part("Read this page carefully and answer. " * 12)) for i in range(4)]
    refs = [want(offline, m, 8) for m in reqs]
    migrations = server.metric("triptych:request_migrations_total")
    before = restarts(server, pool)
    # Freeze one worker of the pool so requests routed to it wait there, then kill it.
    victim = httpx.get(server.base + "/health", timeout=5).json()["pools"][pool]["workers"][0]
    os.kill(victim["pid"], signal.SIGSTOP)
    out: dict = {}
    threads = [threading.Thread(target=stream, args=(client, m, 8, out, i))
               for i, m in enumerate(reqs)]
    for t in threads:
        t.start()
    deadline = time.time() + 60
    while time.time() < deadline and not httpx.get(server.base + "/health").json()[
            "pools"][pool]["workers"][0]["requests"]:
        time.sleep(0.05)
    assert httpx.get(server.base + "/health").json()["pools"][pool]["workers"][0]["requests"]
    os.kill(victim["pid"], signal.SIGKILL)
    for t in threads:
        t.join(180)
    assert [out[i]["error"] for i in range(4)] == [None] * 4
    assert [out[i]["text"] for i in range(4)] == refs, "re-run, not lost"
    assert server.metric("triptych:request_migrations_total") > migrations
    assert wait_ok(server) and restarts(server, pool) == before + 1


def test_kill_9_of_the_server_leaves_nothing_of_any_pool(server):
    """Runs last: P0 killed with every pool running; each worker notices and exits, removing
    its sockets and segments; P0's socket dir goes too."""
    sockets = re.findall(r"sockets in (\S+)", server.log_path.read_text())[0]
    procs = sorted(set(server.descendants) | set(_children(server.proc.pid)))
    assert len(procs) >= 6
    pids = {str(p) for p in procs}
    server.stop(signal.SIGKILL)
    deadline = time.time() + 30  # a hang guard: each worker notices its parent is gone
    while time.time() < deadline and any(alive(p) for p in procs):
        time.sleep(0.1)
    assert not any(alive(p) for p in procs)
    assert not os.path.exists(sockets)
    left = [p for p in glob.glob("/dev/shm/triptych-*") + glob.glob("/tmp/triptych-*")
            if re.match(r"triptych-(\d+)-", os.path.basename(p))
            and re.match(r"triptych-(\d+)-", os.path.basename(p)).group(1) in pids]
    assert left == []
