"""Multi-tenant hardening, round 3 (issue 42), replayed against a real `triptych serve` with
two tenants and an operator key: connections that send nothing, a whitelist of millions of
ids, a progressive JPEG that decodes for seconds, 250,000 empty messages, one tenant filling
the queue, and what /metrics and /v1/models tell a tenant. Each attack ends in a refusal
naming its limit (or costs the others nothing), and the server goes on serving. (The
grammar and the big-answer cases are in test_grammar_budget.py and test_big_answers.py; the
swapped PDF in test_ocr_inputs.py.)"""
from __future__ import annotations

import base64
import json
import os
import socket
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

sys.path.insert(0, os.path.dirname(__file__))
from prometheus_client.parser import text_string_to_metric_families
from server_fixtures import image_part, img, module_server, png, text_part, user
from triptych.bench.attacks import slow_jpeg

KEYS = {"alice": "key-alice-round3-0123", "bob": "key-bob-round3-01234"}
OPERATOR = "key-operator-round3-0"
MAX_PENDING = 8  # engine sequences; a tenant holds at most half
HEADER_TIMEOUT = 2.0


@pytest.fixture(scope="module")
def server(tiny_qwen2_vl, tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys"
    path.write_text("".join(f"{k} {t}\n" for t, k in KEYS.items()))
    path.chmod(0o600)
    yield from module_server(
        tiny_qwen2_vl, tmp_path_factory, "--block-size", "4", "--max-model-len", "512",
        "--served-model-name", "tiny", "--api-keys-file", str(path),
        "--admin-api-key", OPERATOR, "--max-pending-requests", str(MAX_PENDING),
        "--max-pending-share", "0.5", "--http-header-timeout", str(HEADER_TIMEOUT),
        "--max-image-decode-seconds", "1", "--mm-processor-workers", "1",
        "--allowed-media-domains", "127.0.0.1", "--media-fetch-timeout", "60")


def headers(who: str) -> dict[str, str]:
    key = OPERATOR if who == "operator" else KEYS[who]
    return {"Authorization": f"Bearer {key}"}


def chat(server, who: str, messages: list[dict], timeout: float = 120, **extra
         ) -> httpx.Response:
    body = {"model": "tiny", "messages": messages, "max_tokens": 4, "temperature": 0, **extra}
    return httpx.post(server.base + "/v1/chat/completions", json=body, headers=headers(who),
                      timeout=timeout)


def hi() -> list[dict]:
    return user(text_part("hi"))


# -- row 1: connections that send nothing ------------------------------------------------------
def test_idle_connections_cannot_fill_the_server(server):
    """1,030 sockets that send nothing or their headers a line at a time, no key: /health
    and an authenticated client are still answered (no 503), and the silent sockets are
    closed once --http-header-timeout has passed."""
    idle = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(1000)]
    slow = [socket.create_connection(("127.0.0.1", server.port)) for _ in range(30)]
    stop = threading.Event()

    def trickle() -> None:  # a header line every 0.3 s, never the end of the headers
        for s in slow:
            s.sendall(b"GET /v1/models HTTP/1.1\r\nHost: x\r\n")
        while not stop.wait(0.3):
            for s in slow:
                try:
                    s.sendall(b"X-Slow: 1\r\n")
                except OSError:
                    pass

    t = threading.Thread(target=trickle, daemon=True)
    t.start()
    try:
        assert httpx.get(server.base + "/health", timeout=30).status_code == 200
        r = httpx.get(server.base + "/v1/models", headers=headers("alice"), timeout=30)
        assert r.status_code == 200, r.text
        assert chat(server, "bob", hi()).status_code == 200
        deadline = time.monotonic() + HEADER_TIMEOUT + 60  # a hang guard
        for s in idle + slow:  # each closed by the server: its read ends (b"" or a reset)
            s.settimeout(max(0.1, deadline - time.monotonic()))
            try:
                assert s.recv(1024) == b""
            except ConnectionResetError:
                pass
    finally:
        stop.set()
        t.join(5)
        for s in idle + slow:
            s.close()


# -- row 3: a whitelist of millions of ids -----------------------------------------------------
def test_a_whitelist_outside_the_vocabulary_is_refused_and_repeats_are_dropped(server):
    vocab = 632  # the tiny checkpoint's
    # 3 M values: refused as the body arrives, before it is parsed
    r = chat(server, "alice", hi(), vllm_xargs={"ngram_size": 2,
                                               "whitelist_token_ids": list(range(3_000_000))})
    assert r.status_code == 413 and "--max-request-values" in r.json()["error"]["message"]
    # longer than twice the vocabulary (or 65,536): refused by its length, before a walk
    r = chat(server, "alice", hi(), vllm_xargs={"ngram_size": 2,
                                               "whitelist_token_ids": [1] * 70_000})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "vllm_xargs.whitelist_token_ids" and "at most 65536" in err["message"]
    r = chat(server, "alice", hi(), vllm_xargs={"ngram_size": 2,
                                               "whitelist_token_ids": [5, vocab, vocab + 7]})
    assert r.status_code == 400 and "outside the vocabulary" in r.json()["error"]["message"]
    # every id of the vocabulary, ten times over: accepted, served, once each
    r = chat(server, "alice", hi(), vllm_xargs={"ngram_size": 2,
                                               "whitelist_token_ids": list(range(vocab)) * 10})
    assert r.status_code == 200, r.text


# -- row 4: a progressive JPEG whose decoding runs for seconds ---------------------------------
def test_a_slow_image_is_stopped_at_its_deadline_and_text_goes_on(server):
    bomb = "data:image/jpeg;base64," + base64.b64encode(slow_jpeg()).decode()
    good = user(image_part("data:image/png;base64," + base64.b64encode(png(img(3))).decode()),
                text_part("x"))
    assert chat(server, "alice", good).status_code == 200  # (the processes start now)
    before = httpx.get(server.base + "/health", headers=headers("operator"), timeout=30
                       ).json()["preparation"]
    result: dict[str, httpx.Response] = {}

    def attack() -> None:
        result["image"] = chat(server, "alice", user(image_part(bomb), text_part("x")))

    t = threading.Thread(target=attack)
    t.start()
    text = [chat(server, "bob", hi()) for _ in range(3)]  # while the image decodes
    t.join(120)
    assert all(r.status_code == 200 for r in text)
    r = result["image"]
    assert r.status_code == 400, r.text
    assert "--max-image-decode-seconds" in r.json()["error"]["message"]
    # the preparation process was replaced (what it was writing removed): images are
    # served again
    ok = chat(server, "alice", user(image_part("data:image/png;base64," + base64.b64encode(
        png(img(4))).decode()), text_part("x")))  # (a new image: no processor-cache hit)
    assert ok.status_code == 200, ok.text
    prep = httpx.get(server.base + "/health", headers=headers("operator"), timeout=30
                     ).json()["preparation"]
    assert prep["killed"] == before["killed"] + 1 and prep["pids"]
    assert prep["pids"] != before["pids"]
    assert not [n for n in os.listdir("/dev/shm")
                if n.startswith(f"triptych-{before['pids'][0]}-")], "its segment is left"


# -- row 6: 250,000 empty messages -------------------------------------------------------------
def test_a_conversation_too_long_for_the_template_is_refused_before_rendering(server):
    many = [{"role": "user", "content": ""}] * 250_000
    r = chat(server, "alice", many, timeout=60)  # (a hang guard, not a speed claim)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "messages" and "--max-prompt-chars" in err["message"], err
    assert "(250000 messages)" in err["message"], err  # counted in the raw body, unparsed
    assert chat(server, "bob", hi()).status_code == 200


# -- row 7: one tenant fills the queue ---------------------------------------------------------
class _Held(BaseHTTPRequestHandler):
    """Serves one PNG, but only once released: a request whose image it serves holds its
    admission slots meanwhile (slots are taken before media are fetched)."""

    fetched, release = threading.Event(), threading.Event()

    def do_GET(self) -> None:
        _Held.fetched.set()  # (the request was admitted: media are fetched after that)
        _Held.release.wait(60)
        data = png(img(5))
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


def test_one_tenant_holds_at_most_its_share_of_the_queue(server):
    """alice's request of n=4 holds 4 of 8 engine sequences (her share) while its image is
    fetched: her next request gets 429 naming --max-pending-share; bob's is served."""
    httpd = ThreadingHTTPServer(("127.0.0.1", 0), _Held)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    url = f"http://127.0.0.1:{httpd.server_address[1]}/held.png"
    got: dict[str, httpx.Response] = {}
    t = threading.Thread(target=lambda: got.setdefault("held", chat(
        server, "alice", user(image_part(url), text_part("x")), n=4)))
    try:
        t.start()
        assert _Held.fetched.wait(60), "alice's n=4 request was not admitted"
        r = chat(server, "alice", hi())
        assert r.status_code == 429 and "--max-pending-share" in r.json()["error"]["message"]
        assert chat(server, "bob", hi()).status_code == 200
    finally:
        _Held.release.set()
        t.join(60)
        httpd.shutdown()
    assert got["held"].status_code == 200, got["held"].text
    assert len(got["held"].json()["choices"]) == 4
    assert chat(server, "alice", hi()).status_code == 200  # her slots are back


# -- row 5, the batch: a tenant with many long sequences takes turns ----------------------------
def deferrals(server) -> float:
    r = httpx.get(server.base + "/metrics", headers=headers("operator"), timeout=30)
    return sum(s.value for f in text_string_to_metric_families(r.text)
               if f.name == "triptych:tenant_share_deferrals" for s in f.samples)


def test_a_tenant_with_many_long_sequences_is_held_to_its_share_of_a_step(server):
    """alice streams n=4 x 400 tokens; bob's short chats run beside them. While bob has
    work the steps hold alice to her share (--tenant-step-share: her sequences take turns,
    counted in the operator's /metrics); both get whole answers."""
    before = deferrals(server)
    body = {"model": "tiny", "messages": hi(), "n": 4, "max_tokens": 400, "min_tokens": 400,
            "temperature": 1.0, "stream": True}
    with httpx.stream("POST", server.base + "/v1/chat/completions", json=body,
                      headers=headers("alice"), timeout=300) as r:
        lines = r.iter_lines()
        assert r.status_code == 200 and next(lines)  # her sequences are running
        bobs = [chat(server, "bob", hi(), max_tokens=8, min_tokens=8) for _ in range(3)]
        finished = [c["finish_reason"] for line in lines if line.startswith("data: {")
                    for c in json.loads(line[6:])["choices"] if c.get("finish_reason")]
    assert [b.status_code for b in bobs] == [200] * 3
    assert all(b.json()["usage"]["completion_tokens"] == 8 for b in bobs)
    assert finished == ["length"] * 4
    assert deferrals(server) > before


# -- row 9: what /metrics and /v1/models tell a tenant -----------------------------------------
def families(server, who: str | None) -> set[str]:
    r = httpx.get(server.base + "/metrics", headers=headers(who) if who else {}, timeout=30)
    assert r.status_code == 200
    return {f.name for f in text_string_to_metric_families(r.text)}


def test_metrics_show_the_shared_caches_to_the_operator_only(server):
    url = "data:image/png;base64," + base64.b64encode(png(img(11))).decode()
    assert chat(server, "alice", user(image_part(url), text_part("x"))).status_code == 200
    shared = ("triptych:mm_processor_cache_hits", "triptych:encoder_cache_hits",
              "triptych:mm_cache_queries")
    for who in (None, "alice", "bob"):
        names = families(server, who)
        assert "triptych:prompt_tokens" in names  # the rest is there
        assert not any(n.startswith(shared) for n in names), (who, names)
    assert all(any(n.startswith(s) for n in families(server, "operator")) for s in shared)


def test_models_show_no_server_path_to_tenants(server, tiny_qwen2_vl):
    """A tenant sees the served name as the model's root (an open server's single user,
    the operator, sees the checkpoint's path: test_openai_compat.py)."""
    for who in ("alice", "bob"):
        r = httpx.get(server.base + "/v1/models", headers=headers(who), timeout=30)
        assert r.json()["data"][0]["root"] == "tiny", (who, r.json())
        r = httpx.get(server.base + "/v1/models/tiny", headers=headers(who), timeout=30)
        assert r.status_code == 200 and tiny_qwen2_vl not in r.text


def test_the_connection_caps_close_only_old_idle_sockets(monkeypatch):
    """api/connections.py, driven directly: a burst of fresh connections from one address
    is never pushed out by that address's cap (they are about to send requests); one idle
    past the grace period is, the oldest first; the server-wide cap holds at once."""
    import triptych.api.connections as conn

    now = [100.0]
    monkeypatch.setattr(conn.time, "monotonic", lambda: now[0])

    class Sock:
        def __init__(self) -> None:
            self.closed = False

        def close_idle(self, why: str) -> None:
            self.closed = True

    guard = conn.ConnectionGuard(header_timeout_s=10, max_idle=6, max_idle_per_client=2)
    burst = [Sock() for _ in range(4)]
    for s in burst:
        guard.idle(s, "1.2.3.4")
    assert not any(s.closed for s in burst) and guard.num_idle == 4  # fresh: spared
    now[0] += 2.0  # past the grace period
    late = Sock()
    guard.idle(late, "1.2.3.4")
    assert burst[0].closed and not any(s.closed for s in burst[1:])  # the oldest, alone
    for s in burst[1:]:
        guard.busy(s)  # they sent their requests
    others = [Sock() for _ in range(6)]  # fresh, one per address
    for i, s in enumerate(others):
        guard.idle(s, f"10.0.0.{i}")
    assert late.closed  # the server-wide cap closed the oldest idle one, fresh or not
    assert not any(s.closed for s in others) and guard.num_idle == 6
