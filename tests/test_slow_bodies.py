"""Request bodies are budgeted by what arrives (issue 36, row 2), against a real server
with two tenants and raw sockets: connections that announce a large Content-Length and
send nothing (or a byte now and then) hold no budget and get 408 after the deadline,
while another tenant's POST goes through; POST /ping reads no body; one client address
and one tenant hold at most a share of the budget."""
from __future__ import annotations

import os
import socket
import sys
import threading
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

sys.path.insert(0, os.path.dirname(__file__))
import openai
from server_fixtures import module_server, text_part, user, wait_for

KEYS = {"alice": "key-alice-0123456789", "bob": "key-bob-0123456789"}
BODY_CAP = 4_000_000  # --max-request-bytes
INFLIGHT = 8_000_000  # --max-inflight-body-bytes: a share of 0.5 is one BODY_CAP
PAD = 2_500_000  # a body of this much (in "user") fits a share once, not twice


class Hang:
    """A media host that accepts connections and never answers: a request fetching from it
    holds its body in P0 until released. ``count`` says how many requests reached it."""

    def __init__(self) -> None:
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                self.conns.append(self.sock.accept()[0])
            except OSError:
                return

    @property
    def count(self) -> int:
        return len(self.conns)

    def release(self) -> None:
        for c in self.conns:
            c.close()
        self.sock.close()


@pytest.fixture(scope="module")
def server(tiny_qwen2_vl, tmp_path_factory):
    path = tmp_path_factory.mktemp("keys") / "keys"
    path.write_text("".join(f"{k} {t}\n" for t, k in KEYS.items()))
    path.chmod(0o600)
    yield from module_server(tiny_qwen2_vl, tmp_path_factory,
                             "--max-model-len", "512", "--served-model-name", "tiny",
                             "--api-keys-file", str(path), "--max-request-bytes", str(BODY_CAP),
                             "--max-inflight-body-bytes", str(INFLIGHT),
                             "--request-body-timeout", "3", "--allowed-media-domains",
                             "127.0.0.1", "--media-fetch-timeout", "120")


def raw(port: int, path: str, headers: bytes, source: str = "127.0.0.1") -> socket.socket:
    s = socket.create_connection(("127.0.0.1", port), timeout=60,
                                 source_address=(source, 0))
    s.sendall(b"POST " + path.encode() + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n"
              b"Content-Type: application/json\r\n" + headers + b"\r\n")
    return s


def reply(s: socket.socket) -> bytes:
    """The server's answer: headers and a JSON body (bounded by the socket's timeout)."""
    out = b""
    try:
        while not (b"\r\n\r\n" in out and out.rstrip().endswith(b"}")):
            part = s.recv(65536)
            if not part:
                break
            out += part
    except OSError:
        pass
    return out


def bearer(tenant: str) -> bytes:
    return b"Authorization: Bearer " + KEYS[tenant].encode() + b"\r\n"


def test_bodies_that_never_arrive_hold_nothing_and_get_408(server):
    declared = b"Content-Length: %d\r\n" % BODY_CAP
    idle = [raw(server.port, "/v1/chat/completions", declared + bearer("alice"))
            for _ in range(4)]  # 4 x BODY_CAP declared: twice the budget
    pings = [raw(server.port, "/ping", declared) for _ in range(2)]  # no key needed
    trickle = raw(server.port, "/v1/completions", declared + bearer("alice"))
    stop = threading.Event()

    def drip() -> None:  # a byte every 0.2 s: far below --request-body-min-rate
        while not stop.wait(0.2):
            try:
                trickle.sendall(b" ")
            except OSError:
                return

    threading.Thread(target=drip, daemon=True).start()
    try:
        for s in pings:  # answered at once, without waiting for the body
            r = reply(s)
            assert r.startswith(b"HTTP/1.1 200") and r.endswith(b'{"status":"ok"}'), r[:200]
        bob = openai.OpenAI(base_url=server.base + "/v1", api_key=KEYS["bob"], max_retries=0,
                            timeout=60)
        out = bob.chat.completions.create(model="tiny", messages=user(text_part("hi")),
                                          max_tokens=2)
        assert out.choices[0].message.content is not None
        for s in [*idle, trickle]:
            r = reply(s)
            assert r.startswith(b"HTTP/1.1 408"), r[:200]
            assert b"--request-body-timeout" in r
    finally:
        stop.set()
        for s in [*idle, *pings, trickle]:
            s.close()


def post(server, tenant: str, source: str, hang: Hang, i: int) -> httpx.Response:
    """A chat whose image hangs on ``hang`` (its body stays held) with PAD bytes in user."""
    body = {"model": "tiny", "max_tokens": 1, "user": "x" * PAD, "messages": user(
        {"type": "image_url", "image_url": {"url": f"http://127.0.0.1:{hang.port}/{i}.png"}},
        text_part("hi"))}
    with httpx.Client(transport=httpx.HTTPTransport(local_address=source), timeout=180) as c:
        return c.post(server.base + "/v1/chat/completions", json=body,
                      headers={"Authorization": f"Bearer {KEYS[tenant]}"})


@pytest.mark.parametrize("share", ["client", "tenant"])
def test_one_client_or_tenant_holds_at_most_its_share(server, share):
    # client: two requests from one address (both alice); tenant: alice from two addresses.
    # The bystander (bob, a third address) gets in: the budget holds all three otherwise.
    hog = [("alice", "127.0.0.2"), ("alice", "127.0.0.2" if share == "client" else "127.0.0.3")]
    hang = Hang()
    with ThreadPoolExecutor(2) as ex:
        try:
            held = ex.submit(post, server, *hog[0], hang, 0)
            wait_for(lambda: hang.count == 1, "the first body held (its fetch started)")
            second = post(server, *hog[1], hang, 1)
            assert second.status_code == 429, second.text
            assert "--max-body-share" in second.json()["error"]["message"]
            bystander = ex.submit(post, server, "bob", "127.0.0.4", hang, 2)
            wait_for(lambda: hang.count == 2, "the bystander's body held (its fetch started)")
        finally:
            hang.release()
        for fut in (held, bystander):
            r = fut.result(timeout=180)
            assert r.status_code == 400 and "image" in r.text.lower(), r.text  # the fetch
